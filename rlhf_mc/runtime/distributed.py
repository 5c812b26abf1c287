"""torch.distributed and Megatron parallel_state setup for one process of a job.

Environment contract (torchrun's): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
NCCL when CUDA is available, gloo otherwise; without CUDA the Megatron-Core CPU shims are applied first.
"""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from rlhf_mc.config import ParallelConfig


def init_distributed(timeout_minutes: float = 30.0, skip_cpu_shims: tuple[str, ...] = (),
                     store: dist.Store | None = None) -> None:
    """Joins the default process group from torchrun-style environment variables (idempotent); with `store`, through
    that store instead (every rank must pass one then: torch prefixes the keys of the env:// rendezvous, not those of
    a given store, so ranks mixing the two never meet).

    `skip_cpu_shims` is for the tests that show what each shim fixes."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from rlhf_mc.runtime import cpu

        cpu.apply_megatron_shims(skip=skip_cpu_shims)
        backend = "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


def init_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Creates Megatron's TP/PP/VPP/CP/EP/DP groups for `parallel` and seeds every RNG (incl. Megatron's tracker)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel.dp(dist.get_world_size())  # raises a ConfigError naming the fields when the world does not divide
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=1,  # experts whole on each rank (Megatron's default splits them over TP)
    )
    set_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def device() -> torch.device:
    """The device this process computes on: its GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def host_all_reduce(values: torch.Tensor, *groups) -> torch.Tensor:
    """`values` (a small host tensor: counts, metric sums) summed over each group in turn, back on the host. It
    travels through this process's device: NCCL reduces no CPU tensor."""
    out = values.to(device())
    for group in groups:
        dist.all_reduce(out, group=group)
    return out.cpu()


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
