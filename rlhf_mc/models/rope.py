"""Rotary embedding of packed (THD) sequences in one pass.

Megatron-Core's unfused THD rotation (`rope_utils._apply_rotary_pos_emb_thd`, what runs without TE's fused rope)
rotates each packed sequence on its own: in every layer, for queries and keys, a cos, a sin, a few elementwise ops
and a copy per sequence, as many again in backward. An RL micro-batch packs hundreds of short sequences (the
quickstart's: 256 of 14 tokens), and that loop took ~60% of the actor's update on CPU (2048 cos + 2048 sin + 16k copy
calls for 4 layers); on GPU each of those ops is a kernel launch. Here the rotary table is gathered at every token's
position within its sequence (on this CP rank: its two load-balanced chunks of each sequence) and Megatron's own
per-tensor rotation runs once over the whole pack: the same numbers (tests/test_rope.py).

The plain rotation (all of the head's dims, not interleaved: Llama, Qwen, Mistral) is one autograd function, its
forward and backward one function each, compiled into one loop for large inputs on CPU (models/cpu_kernels.py):
Megatron's `_apply_rotary_pos_emb_bshd` negates a half, concatenates the halves, adds, and concatenates the result
with an empty pass-through part, as many again in backward (a bf16 6.3M-parameter training step of 10240 tokens,
torch.profiler: ~100 ms of rotation in 8 layers eager, ~37 ms compiled). Uncompiled, bitwise Megatron's numbers (a +
(-b) is a - b); compiled, rounded once, within two ulps of them (tests/test_rope.py).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from rlhf_mc.models.cpu_kernels import cpu_kernel
from rlhf_mc.runtime.context_parallel import cp_packed_positions

_megatron_thd = rope_utils._apply_rotary_pos_emb_thd


def _apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *args,
                              cp_group=None, **rotation) -> torch.Tensor:
    """Drop-in for Megatron's: t [t_local, heads, d], freqs [max_len, 1, 1, d] (positions 0..max_len-1)."""
    if cp_group is None or args or freqs.size(0) == int(cu_seqlens[-1]):
        # per-token freqs already (Megatron's exact-mapping case), or a call this drop-in was not written for
        return _megatron_thd(t, cu_seqlens, freqs, *args, cp_group=cp_group, **rotation)
    freqs = freqs[cp_packed_positions(cu_seqlens, cp_group.size(), cp_group.rank())]
    # rotation: rotary_interleaved, mscale and the MLA flag under the name of the installed release
    mscale = rotation.get("mscale", 1.0)
    if freqs.size(-1) != t.size(-1) or any(on for name, on in rotation.items() if name != "mscale"):
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs, **rotation).squeeze(1)
    cos, sin = ((f(freqs) * mscale).to(t.dtype).squeeze(1) for f in (torch.cos, torch.sin))  # as Megatron's
    return _Rotation.apply(t, cos, sin)


class _Rotation(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin, with rotate_half(x) = [-x2, x1]; backward: g * cos + [g2 * s2, -g1 * s1]."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, True), None, None


@cpu_kernel
def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """t * cos + [-t2 * s1, t1 * s2], or its transpose (the backward) t * cos + [t2 * s2, -t1 * s1]: Megatron's
    numbers, a + (-b) being a - b (compiled, for large inputs on CPU: rounded once, within an ulp of them)."""
    (t1, t2), (s1, s2) = t.chunk(2, -1), sin.chunk(2, -1)
    halves = [t2 * s2, -(t1 * s1)] if inverse else [-(t2 * s1), t1 * s2]
    return t * cos + torch.cat(halves, -1)


def use_packed_rotary() -> None:
    """Installs the one-pass rotation where Megatron's `apply_rotary_pos_emb` looks it up (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd
