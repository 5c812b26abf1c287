"""One GRPO step of the quickstart config, by phase, and the same step with TRL's GRPOTrainer (where TRL installs:
`pip install trl`) on the same model, prompts and batch: 32 prompts x 8 samples, responses of at most 6 tokens,
the exact-answer reward, one optimizer step per batch, no KL term. JSON lines: our phases (median over the timed
steps), TRL's step time, the ratio.

    python bench/grpo_step.py [--steps 8] [--warmup 2]

Both start from the same random-init HF checkpoint (the time of a step hardly depends on the weights; responses
run to the 6-token limit or an early EOS alike). Ours runs Ray + Megatron + SGLang on CPU; TRL runs transformers'
generate and its trainer in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402

PROMPTS, N, MAX_NEW, LR = 32, 8, 6, 1e-4


def ours(run_dir: Path, steps: int, warmup: int) -> tuple[dict[str, float], Path]:
    from rlhf_mc.trainer.loop import train
    from rlhf_mc.trainer.recipe import load_recipe, make_plan, model_config

    recipe = load_recipe(REPO / "recipes/quickstart.yaml", [
        f"trainer.output_dir={run_dir}", "sft.data_path=", "data.val_path=", f"trainer.total_steps={steps}",
        "trainer.save_interval=0", "trainer.export_hf=false", "trainer.loggers=[jsonl]",
        f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", f"actor.ppo_mini_batch_size={PROMPTS}",
        f"data.max_response_length={MAX_NEW}", f"actor.optim.lr={LR}"])
    train(recipe, make_plan(recipe, model_config(recipe)))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "timing/step_s" in r][warmup:]
    phases = sorted({k for r in timed for k in r if k.startswith("timing/")})
    return {k: statistics.median(r.get(k, 0.0) for r in timed) for k in phases}, run_dir / "init_hf"


def trl_step(model_dir: Path, steps: int, warmup: int) -> float:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_mc.data.dataset import read_rows
    from rlhf_mc.rewards.rules import math_reward

    rows = read_rows(REPO / "recipes/data/arith/train.jsonl")[:PROMPTS * (steps + 1)]
    dataset = datasets.Dataset.from_list([{"prompt": "<s>" + r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **_):
        return [math_reward(c, a) for c, a in zip(completions, answer)]

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(output_dir=str(model_dir.parent / "trl"), use_cpu=True, per_device_train_batch_size=PROMPTS * N,
                        gradient_accumulation_steps=1, num_generations=N, max_completion_length=MAX_NEW,
                        learning_rate=LR, max_steps=steps, beta=0.0, temperature=1.0, logging_steps=1,
                        report_to="none", save_strategy="no", loss_type="grpo", shuffle_dataset=False)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        phases, model_dir = ours(Path(tmp) / "ours", args.steps, args.warmup)
        for key, seconds in phases.items():
            emit(figure=f"ours {key}", value=round(seconds, 4), unit="s", steps=args.steps - args.warmup)
        try:
            import trl  # noqa: F401
        except ImportError:
            emit(figure="trl GRPOTrainer step", value=None, note="trl is not installed: pip install trl")
            return
        step = trl_step(model_dir, args.steps, args.warmup)
        ours_step = phases["timing/step_s"]
        emit(figure="GRPO step, 32 prompts x 8 samples, tiny-arith, CPU", ours_s=round(ours_step, 3),
             baseline="trl GRPOTrainer (transformers generate)", baseline_s=round(step, 3),
             ratio_baseline_over_ours=round(step / ours_step, 2))


if __name__ == "__main__":
    main()
