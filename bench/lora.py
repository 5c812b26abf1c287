"""LoRA against full fine-tuning on the real model, the whole GRPO step as the trainer runs it: step time by phase,
weight-sync bytes and seconds, peak memory (the largest process: an actor rank; and all of the run's processes),
alternated in one invocation (full, LoRA with the adapter synced into SGLang's LoRA serving, LoRA with the adapted
layers synced merged; then again with --rounds). The recipe is recipes/grpo_smollm2_135m.yaml (and its LoRA twin's
adapter settings: rank 16, alpha 32, every linear layer) with the same work in every run: no validation, no dynamic
sampling, every response --response-length tokens long (rollout.ignore_eos). JSON lines: one per run, then one per
LoRA kind with its ratios to full fine-tuning (medians over the rounds).

    python bench/lora.py [--steps 4] [--warmup 1] [--rounds 1] [--response-length 48] [--kinds full lora merged]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit, peak_memory  # noqa: E402

RECIPE = REPO / "recipes/grpo_smollm2_135m.yaml"
LORA = ["actor.lora.enabled=true", "actor.lora.rank=16", "actor.lora.alpha=32", "actor.lora.target_modules=[all-linear]",
        "actor.optim.lr=5.0e-5"]
KINDS = {"full": [], "lora": [*LORA, "actor.lora.sync=adapter"], "merged": [*LORA, "actor.lora.sync=merged"]}


def run(kind: str, run_dir: Path, steps: int, warmup: int, response_length: int) -> dict:
    from rlhf_mc.trainer.loop import train
    from rlhf_mc.trainer.plan import make_plan
    from rlhf_mc.trainer.recipe import load_recipe, model_config

    recipe = load_recipe(RECIPE, [
        f"trainer.output_dir={run_dir}", "data.val_path=", f"trainer.total_steps={steps}", "trainer.save_interval=0",
        "trainer.export_hf=false", "trainer.loggers=[jsonl]", "algorithm.dynamic_sampling_max_rounds=0",
        "rollout.ignore_eos=true", f"data.max_response_length={response_length}", *KINDS[kind]])
    with peak_memory() as memory:
        train(recipe, make_plan(recipe, model_config(recipe)))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "timing/step_s" in r][warmup:-1]  # the last step also saves the final checkpoint
    keys = sorted(k for k in timed[0] if k.startswith("timing/") or k.startswith("sync/"))
    out = {k: round(statistics.median(r[k] for r in timed), 4) for k in keys}
    return {**out, "peak_process_mb": round(memory["peak_process_mb"]), "peak_total_mb": round(memory["peak_total_mb"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    args = parser.parse_args()
    if args.steps < args.warmup + 2:
        parser.error(f"--steps {args.steps}: at least --warmup + 2 = {args.warmup + 2}")
    if not (REPO / "runs/models/SmolLM2-135M-Instruct/config.json").is_file():
        parser.error("the model is not prepared: python tools/prepare_model.py")
    results: dict[str, list[dict]] = {kind: [] for kind in args.kinds}
    for r in range(args.rounds):
        for kind in args.kinds if r % 2 == 0 else args.kinds[::-1]:  # alternated: no kind always runs first
            with tempfile.TemporaryDirectory() as tmp:
                figures = run(kind, Path(tmp) / kind, args.steps, args.warmup, args.response_length)
            results[kind].append(figures)
            emit(figure="grpo step, SmolLM2-135M", kind=kind, round=r, **figures)
    if "full" not in results:
        return
    for kind in (k for k in args.kinds if k != "full"):
        ratios = {}
        for key in ("timing/step_s", "timing/update_actor_s", "timing/ref_logprob_s", "timing/sync_s",
                    "sync/bytes", "peak_process_mb", "peak_total_mb"):
            pairs = [(f.get(key), o.get(key)) for f, o in zip(results["full"], results[kind])]
            if all(a and b for a, b in pairs):
                ratios[f"{key}_full_over_{kind}"] = round(statistics.median(a / b for a, b in pairs), 3)
        emit(figure="full fine-tuning over LoRA", kind=kind, rounds=args.rounds, baseline="full", **ratios)


if __name__ == "__main__":
    main()
