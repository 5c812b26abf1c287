"""Offloading the training state (actor.offload): the bytes the state holds on its device while the engines generate,
with offload vs without (the baseline, same process), and the seconds to offload and reload, for a Qwen3-0.6B-shaped
model cut to a few layers and a smaller vocabulary (fp32, CPU, distributed optimizer, after one SFT step so Adam's
moments exist). Prints JSON lines.

    .venv/bin/python bench/offload.py [--layers 4] [--vocab 32000] [--repeats 5]

On CPU the host copy lives in the same memory, so the figure is the storage the state keeps on its device, not the
process's RSS; the seconds are host-to-host copies (GPU: device-to-pinned-host, measured where a GPU is lent).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402
from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn  # noqa: E402


def _resident_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def measure(model: ModelConfig, repeats: int) -> dict:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.runtime.offload import (gradient_tensors, offload_training_state, optimizer_tensors, reload,
                                        weight_tensors)
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.train import sft_step

    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(model, ParallelConfig())
    state = setup_training(chunks, OptimizerConfig(lr=1e-5))
    g = torch.Generator().manual_seed(0)
    sft_step(state, Trajectories.single_turn([torch.randint(0, model.vocab_size, (256,), generator=g)
                                              for _ in range(4)], [128] * 4), 1024)
    tensors = [*weight_tensors(chunks), *gradient_tensors(chunks, state.optimizer),
               *optimizer_tensors(state.optimizer)]
    baseline = _resident_bytes(tensors)
    host, offload_s, reload_s, during = [], [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        host = offload_training_state(chunks, state.optimizer, "all", reuse=host)
        offload_s.append(time.perf_counter() - start)
        during.append(sum(t.untyped_storage().nbytes() for t in tensors))
        start = time.perf_counter()
        reload(host)
        reload_s.append(time.perf_counter() - start)
    return {"params": sum(p.numel() for p in chunks[0].parameters()), "baseline_bytes": baseline,
            "offloaded_bytes": max(during), "offload_s": statistics.median(offload_s),
            "first_offload_s": offload_s[0], "reload_s": statistics.median(reload_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = dataclasses.replace(ModelConfig.from_yaml(REPO / "model_configs" / "qwen3-0.6b.yaml"),
                                num_layers=args.layers, vocab_size=args.vocab)
    (r,) = spawn(measure, 1, model, args.repeats)
    mb = 2**20
    emit(bench="offload", figure="training_state_on_device_mb", params=r["params"],
         offloaded=round(r["offloaded_bytes"] / mb, 1), baseline=round(r["baseline_bytes"] / mb, 1),
         ratio=r["offloaded_bytes"] / r["baseline_bytes"])
    emit(bench="offload", figure="seconds", offload=round(r["offload_s"], 3), reload=round(r["reload_s"], 3),
         first_offload=round(r["first_offload_s"], 3),
         gb_per_s=round(r["baseline_bytes"] / 2**30 / r["offload_s"], 2))


if __name__ == "__main__":
    main()
