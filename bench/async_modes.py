"""Rollout modes on CPU: samples/s and trained tokens/s of sync vs one_step_off vs async, in the same invocation,
with the idle fractions of the trainer (waiting for rollouts) and of the engines (between rollouts).

    python bench/async_modes.py [--steps 8] [--response-length 54] [--prompts 16] [--n 8] [--max-staleness 1]

Each mode runs the quickstart recipe through tools/launch.py from the same random-init model on two processes (the
actor on one, the SGLang engine on the other: rollout.placement=disaggregated, which one_step_off needs and sync
gets too, for a fair comparison), no SFT, no validation; async with rollout.max_staleness. A random model ends a
response at its eos with about the probability of any of the 16 tokens, so response lengths are geometric with a
long tail up to the limit: the shape where a rollout waits for its longest sample. The first step (start-up) and
checkpoint steps are not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402


def run(mode: str, out: Path, args) -> dict:
    overrides = [f"trainer.output_dir={out}", "sft.data_path=", "data.val_path=", f"trainer.total_steps={args.steps}",
                 f"data.max_response_length={args.response_length}", f"data.train_batch_size={args.prompts}",
                 f"rollout.n={args.n}", f"actor.ppo_mini_batch_size={args.prompts}", "trainer.save_interval=0",
                 "trainer.loggers=[jsonl]", "rollout.placement=disaggregated", "resources.devices_per_node=2",
                 "rollout.engine.num_engines=1", f"rollout.mode={mode}", "trainer.export_hf=false"]
    overrides += [f"rollout.max_staleness={args.max_staleness}"] if mode == "async" else []
    result = subprocess.run([sys.executable, "tools/launch.py", "recipes/quickstart.yaml", *overrides], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{mode} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s and 1 < s["step"] < args.steps]  # no start-up, no final save
    seconds = sum(s["timing/step_s"] for s in steps)
    samples = sum(s["data/samples"] for s in steps)
    tokens = sum(s["data/samples"] * s["response/length_mean"] for s in steps)
    return {"mode": mode, "steps_timed": len(steps),
            "step_s_median": statistics.median(s["timing/step_s"] for s in steps),
            "samples_per_s": samples / seconds, "trained_tokens_per_s": tokens / seconds,
            "trainer_idle_fraction": sum(s["idle/trainer_s"] for s in steps) / seconds,
            "engines_idle_fraction": sum(s["idle/engines_s"] for s in steps) / seconds,
            "rollout_s_median": statistics.median(s["timing/rollout_s"] for s in steps),
            "update_s_median": statistics.median(s["timing/update_actor_s"] for s in steps),
            "response_length_mean": tokens / samples,
            "response_length_max": max(s["response/length_max"] for s in steps),
            "staleness_max": max(s["rollout/staleness_max"] for s in steps),
            "staleness_mean": statistics.mean(s["rollout/staleness_mean"] for s in steps),
            "partial_fraction": statistics.mean(s["rollout/partial_fraction"] for s in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=54)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlhf_mc_bench_async_") as tmp:
        figures = {mode: run(mode, Path(tmp) / mode, args) for mode in ("sync", "one_step_off", "async")}
    for row in figures.values():
        emit(**row)
    sync = figures["sync"]
    for mode in ("one_step_off", "async"):
        emit(metric=f"{mode} / sync", samples_per_s=figures[mode]["samples_per_s"] / sync["samples_per_s"],
             trained_tokens_per_s=figures[mode]["trained_tokens_per_s"] / sync["trained_tokens_per_s"])


if __name__ == "__main__":
    main()
