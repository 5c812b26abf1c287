"""Causal attention over packed sequences on CPU without gradients (log-prob passes): a C++ loop around MKL's GEMMs,
cpu_causal_attention.cpp, one call for a whole pack.

SDPA's CPU flash kernel takes keys in blocks of 512 and attends every query of a block to every key of the key block
it reaches before masking: a causal sequence of up to 512 tokens costs the whole square, not the triangle. Here each
block of 64 positions takes only the keys up to its last position (blocks of 512 keys beyond), with an online
softmax, and the heads of a KV group are stacked into one GEMM with the group's keys and one with its values.
bench/cpu_attention.py (bench/ref_logprob.py's 300 sequences of 96-576 tokens, 8 heads over 4 KV groups of 32, the
ranks' environment; 2026-12-06): one thread, bf16 254 against SDPA's 443 ms a layer (1.74x), fp32 369 against
663 ms (1.80x); two threads, bf16 136 against 240 ms (1.76x), fp32 248 against 393 ms (1.58x). Its largest error
against SDPA in fp64 is SDPA's own in bf16 (0.010) and 1.4e-6 against SDPA's 1.1e-6 in fp32. With gradients SDPA
runs: its backward needs its own forward's saved state.

The library is built on first use with the C++ compiler (~1.5 s; runtime/host.py's build_library, -march=native: this
machine's vector units, -fopenmp: torch's threads) and takes its GEMMs from torch's CPU library (MKL: `sgemm_` and
`cblas_gemm_bf16bf16f32`). Where either is missing (no compiler, a torch without MKL), `applies` is False and SDPA
runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from rlhf_mc.runtime.host import build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
# dtype -> (the library's entry point, the MKL GEMM it calls)
ENTRY_POINTS = {torch.float32: ("causal_attention_f32", "sgemm_"),
                torch.bfloat16: ("causal_attention_bf16", "cblas_gemm_bf16bf16f32")}


@functools.cache
def _kernels() -> dict[torch.dtype, tuple[ctypes._CFuncPtr, int]] | None:
    """dtype -> (entry point, address of its GEMM); None where the library cannot be had."""
    without = "log-prob passes attend with SDPA (slower on CPU)"
    lib = build_library("cpu_causal_attention", SOURCE.read_text(), "c++",
                        ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-lmvec"], without)
    if lib is None:
        return None
    try:
        kernels = ctypes.CDLL(lib)
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return {dtype: (getattr(kernels, entry), ctypes.cast(getattr(torch_cpu, gemm), ctypes.c_void_p).value)
                for dtype, (entry, gemm) in ENTRY_POINTS.items()}
    except (OSError, AttributeError) as e:  # torch's libraries laid out otherwise, or built without MKL
        log.warning("%s: %s", e, without)
        return None


def applies(query: torch.Tensor) -> bool:
    """Whether `query` (and its keys and values, alike) can take this kernel: on CPU, fp32 or bf16, no gradient."""
    return (query.device.type == "cpu" and query.dtype in ENTRY_POINTS
            and not (query.requires_grad and torch.is_grad_enabled()) and _kernels() is not None)


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                            scale: float) -> torch.Tensor:
    """query [t, heads, d], key/value [t, groups, d] holding the sequences of `lengths` one after another ->
    [t, heads, d]: each token attends to the tokens of its own sequence up to itself (heads share their group's keys
    and values, heads // groups a group)."""
    entry, gemm = _kernels()[query.dtype]
    # the kernel steps over tokens by each tensor's first stride and needs the heads and their dims dense
    query, key, value = (x if x.stride(2) == 1 and x.stride(1) == x.size(2) else x.contiguous()
                         for x in (query, key, value))
    out = torch.empty(query.shape, dtype=query.dtype)
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    heads, groups, d = query.size(1), key.size(1), query.size(2)
    pointer, stride = ctypes.c_void_p, ctypes.c_int64
    entry(pointer(gemm), pointer(query.data_ptr()), pointer(key.data_ptr()), pointer(value.data_ptr()),
          pointer(out.data_ptr()), pointer(cu.data_ptr()), len(lengths), heads, groups, d, stride(query.stride(0)),
          stride(key.stride(0)), stride(value.stride(0)), stride(out.stride(0)), ctypes.c_float(scale))
    return out
