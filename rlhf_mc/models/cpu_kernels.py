"""Element-wise work of the training step compiled into fused CPU loops by torch.compile (Inductor's C++ backend).

On CPU every eager element-wise op is one pass over memory, bandwidth-bound once a [tokens, hidden] tensor outgrows the
caches ([10240, 1, 256] bf16: ~1 ms a pass on 2 cores). RMSNorm's forward and backward are ~20 such passes, SwiGLU's
~8 over [tokens, 2 x ffn]; Inductor fuses each function given to `cpu_kernel` into one or two loops that keep the
intermediates in registers (RMSNorm forward + backward at [10240, 1, 256] bf16: 11.3 -> 1.4 ms).

A function is compiled on its first call in a process with dynamic shapes (one kernel for every token count; one per
dtype and hidden size), and Inductor keeps the generated code on disk (TORCHINDUCTOR_CACHE_DIR, by default
/tmp/torchinductor_$USER). That costs a process ~13 s the first time on a machine and ~2.7 s after (importing dynamo
and Inductor, tracing, loading the cached kernels): worth it for tensors of COMPILE_FROM elements or more, where a
step saves tens of milliseconds (a 0.8M model's train step over 3584 tokens, [3584, 128] activations, one process:
bf16 0.137 -> 0.109 s, fp32 0.183 -> 0.166 s with the bound lowered from 2^19 to 2^18; 2^17 gains nothing more);
smaller calls (tiny models, short batches) run the same function uncompiled.
Used on CPU only (build_model installs the norm and the SwiGLU there); on GPU torch's and Megatron's fused kernels
run.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

COMPILE_FROM = 1 << 18  # elements of the first argument


def cpu_kernel(fn: Callable) -> Callable:
    """`fn` (pure tensor code, no Python side effects), compiled on its first call with a first argument on CPU of
    COMPILE_FROM elements or more; called as it is otherwise."""
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if args[0].numel() < COMPILE_FROM or not args[0].is_cpu:
            return fn(*args)
        if compiled is None:
            # a graph per dtype and hidden size (layers', q/k norms'): more than dynamo's default 8 in a process
            # that builds several models (the tests); past the limit a call would run `fn` uncompiled
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args)

    return run
