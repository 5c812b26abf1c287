"""Shared by the bench scripts: JSON-line output, peak memory of a piece of work (child processes included), this
machine's fp32 matmul FLOP/s, a Llama-shaped model's matmul parameters and transformers' model of a ModelConfig."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import threading
import time
from contextlib import contextmanager

import psutil
import torch


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


@contextmanager
def peak_memory(interval_s: float = 0.02):
    """Samples the RSS of this process's descendants (the measured work runs in child processes, so the bench
    process's own memory does not count); yields a dict that, after the block, holds `peak_total_mb` (largest sum
    over the children), `peak_process_mb` (largest single child) and `seconds`."""
    me = psutil.Process()
    result = {"peak_total_mb": 0.0, "peak_process_mb": 0.0, "seconds": 0.0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            sizes = []
            for proc in me.children(recursive=True):
                try:
                    sizes.append(proc.memory_info().rss / 2**20)
                except psutil.Error:
                    pass
            result["peak_total_mb"] = max(result["peak_total_mb"], sum(sizes))
            result["peak_process_mb"] = max(result["peak_process_mb"], max(sizes, default=0.0))
            stop.wait(interval_s)

    thread = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["seconds"] = time.perf_counter() - start


def matmul_flops(seconds: float = 3.0, dtype: str = "float32") -> float:
    """This machine's matmul FLOP/s in `dtype` (1024^3 products on all the cores torch uses here)."""
    a, b = (torch.randn(1024, 1024, dtype=getattr(torch, dtype)) for _ in range(2))
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * 1024 ** 3 * count / (time.perf_counter() - start)


def _to_queue(fn, args, queue) -> None:
    try:
        queue.put((True, fn(*args)))
    except BaseException as e:  # the parent re-raises it (else it would wait for a result forever)
        queue.put((False, f"{type(e).__name__}: {e}"))
        raise


def in_child(fn, *args, as_rank: bool = False):
    """fn(*args) in a fresh process (its own memory and threads); `as_rank`: started as rlhf_mc starts its CPU
    ranks (runtime/host.py's exec_env: MKL's AVX-512 kernels on an AMD CPU), else as a user's plain process."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_to_queue, args=(fn, args, queue))
    from rlhf_mc.runtime import host

    with host.children_as_cpu_ranks() if as_rank else contextlib.nullcontext():
        proc.start()
    ok, result = queue.get()
    proc.join()
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its child process: {result}")
    return result


def matmul_peak(dtype: str = "float32") -> float:
    """This machine's matmul FLOP/s in `dtype`, what MFU figures divide by: measured in a plain process (torch as
    a user's script runs it) and in one started as rlhf_mc starts its CPU ranks (on an AMD CPU, MKL's AVX-512
    kernels: runtime/host.py); prints both, returns the larger. (bf16 on a CPU with AMX: 5-10x fp32's.)"""
    here = in_child(matmul_flops, 3.0, dtype)
    rank = in_child(matmul_flops, 3.0, dtype, as_rank=True)
    emit(figure=f"{dtype} matmul FLOP/s (1024^3, this machine)", value=round(max(here, rank) / 1e9, 1), unit="GFLOP/s",
         threads=torch.get_num_threads(), plain_torch=round(here / 1e9, 1), rlhf_mc_rank=round(rank / 1e9, 1))
    return max(here, rank)


def transformers_model(model, dtype: str = "bfloat16"):
    """transformers' causal LM of the shape of our ModelConfig `model`, randomly initialized (SDPA attention), on
    torch's current default device."""
    import transformers as T

    from rlhf_mc.bridge.hf_config import hf_config_from_model

    config = T.AutoConfig.for_model(**{k: v for k, v in hf_config_from_model(model, dtype).items()
                                       if k != "architectures"})
    return T.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")


def llama_matmul_params(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int
                        ) -> int:
    """The parameters a token's forward multiplies by (2 FLOPs each): every layer's q, k, v, o and gated MLP, and the
    LM head (not the embedding: a lookup)."""
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    return layers * (attention + 3 * hidden * ffn) + vocab * hidden
