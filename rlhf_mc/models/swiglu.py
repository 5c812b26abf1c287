"""SwiGLU for Megatron's MLP on CPU: one autograd function in place of Megatron's compiled one.

Megatron's MLP has two SwiGLU paths. The fused one (`bias_activation_fusion`, its default on GPU) is built by
torch.compile: on CPU 1.5 s per process to load and 19 s to build. The unfused one chunks fc1's output, adds
`glu_linear_offset` (0.0: a full copy of the up half), applies SiLU and multiplies, and its backward concatenates the
two halves' gradients: six passes over [tokens, ffn] and an extra [tokens, 2 x ffn] copy per layer. Here the forward
is SiLU and a multiply, and the backward writes both halves' gradients straight into one buffer (SiLU's own
backward kernel for the gate, so the numbers are bitwise Megatron's unfused ones: tests/test_swiglu.py). Measured
with MKL as our ranks run it (2 cores, [10240, 1, 2 x 768]): forward and backward 29.7 -> 15.9 ms per layer, forward
alone 7.0 -> 5.1 ms. It keeps fc1's output and SiLU(gate) for backward, one [tokens, ffn] less than the unfused path.

`use_eager_swiglu` installs it where Megatron's MLP and shared experts look up `bias_swiglu_impl` and
`weighted_bias_swiglu_impl`, the functions `bias_activation_fusion` calls (models/gpt.py sets that flag everywhere;
on GPU Megatron's compiled kernels run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        gate, up = y.chunk(2, -1)
        act = F.silu(gate)
        ctx.save_for_backward(y, act)
        return act * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        y, act = ctx.saved_tensors
        gate, up = y.chunk(2, -1)
        grad_y = torch.empty_like(y)
        grad_gate, grad_up = grad_y.chunk(2, -1)
        torch.mul(grad, act, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_y


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None, *unused) -> torch.Tensor:
    """Drop-in for megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl (`unused`: its fp8 and activation
    offloading flags, GPU features)."""
    if bias is not None:
        y = y + bias
    return _SwiGLU.apply(y)


def weighted_bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor, *unused) -> torch.Tensor:
    """Drop-in for fused_bias_swiglu.weighted_bias_swiglu_impl: SwiGLU scaled per token (an MoE expert's MLP gets
    its routing probabilities so from Megatron's SequentialMLP), as the unfused path computes it."""
    return (bias_swiglu(y, bias) * weights).to(y.dtype)


def use_eager_swiglu() -> None:
    """Installs bias_swiglu and weighted_bias_swiglu where Megatron's MLP (dense layers, and the experts of the
    SequentialMLP that MoE layers use without TE) and shared experts call the fused SwiGLU (idempotent)."""
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import shared_experts

    for module, name, fn in ((mlp, "bias_swiglu_impl", bias_swiglu), (mlp, "weighted_bias_swiglu_impl",
                             weighted_bias_swiglu), (shared_experts, "bias_swiglu_impl", bias_swiglu)):
        if not hasattr(module, name):  # the names this relies on; refuse rather than compile silently
            raise RuntimeError(f"{module.__name__} has no {name}: this Megatron-Core release is not supported by "
                               "rlhf_mc.models.swiglu")
        setattr(module, name, fn)
