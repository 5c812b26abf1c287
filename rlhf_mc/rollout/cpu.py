"""Everything SGLang needs to serve on a machine without a GPU, in one place; used only when CUDA is absent.

- `cpu_site/`: a stand-in for the CUDA kernel package `sgl_kernel` (SGLang's CPU backend imports names from it at
  module level and never calls them on the normal path) and a sitecustomize that makes torch.cuda.synchronize a
  no-op (release_memory_occupation calls it). Put first on the server's PYTHONPATH.
- SGLANG_USE_CPU_ENGINE=1 and `--device cpu`; OMP_NUM_THREADS = the machine's cores / TP (not Ray's 1); glibc
  malloc settings that keep freed memory and MKL's AVX-512 kernels on AMD CPUs (runtime/host.py); a KV cache of
  65536 tokens and mem_fraction_static 0.1 unless the config says otherwise (SGLang's defaults reserve ~14 GB).
- TP > 1: SGLang asserts that ranks <= NUMA nodes unless each rank is given its cores
  (SGLANG_CPU_OMP_THREADS_BIND, "0|1" on a 2-core machine). And with the CUDA build of torch, NCCL's library is
  installed, so SGLang's TP group builds a PyNccl communicator, which fails on a CPU device ("Expected a cuda device,
  but got: cpu"); pointing SGLANG_NCCL_SO_PATH at no library makes SGLang skip it (its gloo group does the work).
- Colocated weight updates: the sender shares tensors through files, not file descriptors
  (torch.multiprocessing's default fd passing makes the server fail to rebuild them and die). A payload whose buffer
  carries every bucket (a staging, marked KEEP_MAPPED) stays mapped in the server (cpu_site/sitecustomize.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlhf_mc.runtime import host

CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
KEEP_MAPPED = "rlhf_mc_keep_mapped"  # a weight payload's key: its buffer is a staging reused for every bucket


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def thread_binding(tp: int, cores: int | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value giving each of `tp` ranks an equal, disjoint range of cores."""
    cores = cores or os.cpu_count() or 1
    if tp > cores:
        raise ValueError(f"rollout.tp: {tp} ranks need at least {tp} cores on CPU, this machine has {cores}")
    per_rank = cores // tp
    ranges = [(r * per_rank, (r + 1) * per_rank - 1) for r in range(tp)]
    return "|".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def server_env(env: dict[str, str], tp: int) -> dict[str, str]:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(CPU_SITE), *filter(None, [env.get("PYTHONPATH")])])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # A server started from a Ray actor inherits Ray's OMP_NUM_THREADS=1: it would decode on one core of the machine.
    env["OMP_NUM_THREADS"] = str(host.cores_per(tp))
    env.update(host.exec_env(env))
    if tp > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", thread_binding(tp))
        env["SGLANG_NCCL_SO_PATH"] = str(CPU_SITE / "no-nccl-on-cpu.so")  # does not exist, on purpose
    return env


def server_args(max_total_tokens: int | None, mem_fraction_static: float | None) -> list[str]:
    return ["--device", "cpu", "--max-total-tokens", str(max_total_tokens or 65536),
            "--mem-fraction-static", str(mem_fraction_static or 0.1)]


def prepare_tensor_sender() -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
