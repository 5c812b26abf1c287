"""Smoke run of the training stack: a tiny Llama-style model at TP=2 across 2 processes (gloo on CPU, NCCL on GPUs)
does forward, backward and a distributed-optimizer step per iteration on one fixed batch, and prints the loss.
The loss falls as the model memorizes the batch.

    python tools/smoke_train.py [--steps 8] [--model model_configs/tiny-llama.yaml] [--tp 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn  # noqa: E402


def train(model_path: str, tp: int, steps: int, seq_len: int) -> list[dict]:
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.models.pipeline import run_pipeline
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel

    model = ModelConfig.from_yaml(model_path)
    parallel = ParallelConfig(tp=tp)
    init_parallel(parallel, seed=0)
    state = setup_training(build_model(model, parallel), OptimizerConfig(lr=3e-3, weight_decay=0.0))
    tokens = torch.randint(0, model.vocab_size, (4, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "position_ids": torch.arange(seq_len).expand(4, seq_len).contiguous()}

    def mean_loss(mb, token_loss):
        loss = token_loss.mean()
        return loss, {"loss": loss.detach().clone()}

    log = []
    for step in range(steps):
        state.zero_grad()
        (report,) = run_pipeline(state.model, [batch], mean_loss, forward_only=False)
        stats = state.step()
        log.append({"step": step, "loss": round(report["loss"].item(), 4),
                    "grad_norm": round(stats["grad_norm"], 4), "lr": stats["lr"]})
        if torch.distributed.get_rank() == 0:
            print(json.dumps(log[-1]), flush=True)
    return log if ps.get_tensor_model_parallel_rank() == 0 else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "model_configs/tiny-llama.yaml"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    ParallelConfig(tp=args.tp).check_model(ModelConfig.from_yaml(args.model))  # fail before starting processes
    log = spawn(train, args.tp, args.model, args.tp, args.steps, args.seq_len)[0]
    print(f"smoke run done: tp={args.tp}, loss {log[0]['loss']} -> {log[-1]['loss']} in {args.steps} steps")


if __name__ == "__main__":
    main()
