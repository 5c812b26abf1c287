"""Everything SGLang needs to serve on a machine without a GPU, in one place; used only when CUDA is absent.

- `cpu_site/`: a stand-in for the CUDA kernel package `sgl_kernel` (SGLang's CPU backend imports names from it at
  module level and never calls them on the normal path) and a sitecustomize that makes torch.cuda.synchronize a
  no-op (release_memory_occupation calls it). Put first on the server's PYTHONPATH.
- SGLANG_USE_CPU_ENGINE=1 and `--device cpu`; OMP_NUM_THREADS = the cores of one device slot (not Ray's 1); glibc
  malloc settings that keep freed memory and MKL's AVX-512 kernels on AMD CPUs (runtime/host.py); a KV cache of
  65536 tokens unless the config says otherwise (SGLang's defaults reserve ~14 GB); mem_fraction_static 0.5 unless
  the config says otherwise, which with the token cap allocates nothing more: SGLang refuses to start when the
  node's free memory fell by more than 1 - mem_fraction_static while it loaded its weights, and on a CPU node the
  trainer's ranks load theirs at the same time (engines start first). At 0.1 a 135M model's engine was refused
  (SmolLM2 in fp32: the two ranks took >10% of 24 GB meanwhile).
- SGLang spawns its scheduler and detokenizer processes, which import SGLang and torch again; a TP=1 server forks
  them instead (cpu_site/sitecustomize.py): a start took 44-46 s spawned and 23-39 s forked, on 2 cores with
  another server starting (bench/server_lifecycle.py --rounds 1).
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
FORK_SCHEDULER = "RLHF_MC_FORK_SCHEDULER"  # set in a TP=1 server's environment: its scheduler is forked
KEEP_MAPPED = "rlhf_mc_keep_mapped"  # a weight payload's key: its buffer is a staging reused for every bucket


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def thread_binding(slots: range, slots_on_host: int, cores: int | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value for an engine whose TP ranks sit on device `slots` of the `slots_on_host`
    on this machine: each slot an equal, disjoint range of the cores (slots share cores when they outnumber them)."""
    cores = cores or os.cpu_count() or 1

    def core_range(slot: int) -> str:
        a = slot * cores // slots_on_host
        b = max(a, (slot + 1) * cores // slots_on_host - 1)
        return f"{a}" if a == b else f"{a}-{b}"

    return "|".join(core_range(s) for s in slots)


def server_env(env: dict[str, str], slots: range, slots_on_host: int) -> dict[str, str]:
    """The server's environment when its TP ranks sit on device `slots` of the `slots_on_host` on this machine. A
    device slot on CPU is an equal share of the cores, as a trainer rank's (runtime/host.py): engines that decode at
    once each take their own cores. Two engines of one thread each rolled out 10-27% faster than one engine on both
    cores (256 samples; 6.3M / 32 tokens 1.11 -> 1.00 s, 0.8M / 6 0.151 -> 0.117 s): a server's Python
    (scheduling, the model's forward, the results) runs on one core, and the other core waits meanwhile unless
    another engine uses it."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(CPU_SITE), *filter(None, [env.get("PYTHONPATH")])])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # A server started from a Ray actor inherits Ray's OMP_NUM_THREADS=1: it would decode on one core of the machine.
    env["OMP_NUM_THREADS"] = str(host.cores_per(slots_on_host))
    env.update(host.exec_env(env))
    # SGLang binds each rank's threads to these cores where it can (AMX and arm64 CPUs) and, without it, asserts
    # that the ranks of all its servers fit the NUMA nodes.
    env["SGLANG_CPU_OMP_THREADS_BIND"] = thread_binding(slots, slots_on_host)
    if len(slots) > 1:
        env["SGLANG_NCCL_SO_PATH"] = str(CPU_SITE / "no-nccl-on-cpu.so")  # does not exist, on purpose
    else:
        # one scheduler: forked from the server process instead of spawned (cpu_site/sitecustomize.py); at TP > 1
        # forked schedulers hung the TP=2 weight sync (an earlier try), so those stay spawned
        env[FORK_SCHEDULER] = "1"
    return env


def server_args(max_total_tokens: int | None, mem_fraction_static: float | None) -> list[str]:
    return ["--device", "cpu", "--max-total-tokens", str(max_total_tokens or 65536),
            "--mem-fraction-static", str(mem_fraction_static or 0.5)]


def prepare_tensor_sender() -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
