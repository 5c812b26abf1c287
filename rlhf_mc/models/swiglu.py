"""SwiGLU for Megatron's MLP on CPU: one autograd function in place of Megatron's compiled one.

Megatron's MLP has two SwiGLU paths. The fused one (`bias_activation_fusion`, its default on GPU) is built by
torch.compile: on CPU 1.5 s per process to load and 19 s to build. The unfused one chunks fc1's output, adds
`glu_linear_offset` (0.0: a full copy of the up half), applies SiLU and multiplies, and its backward concatenates the
two halves' gradients: six passes over [tokens, ffn] and an extra [tokens, 2 x ffn] copy per layer. Here the forward
is SiLU and a multiply, and the backward SiLU's own backward op for the gate and a multiply for the up half, both
compiled into one loop each for large inputs (models/cpu_kernels.py; uncompiled, the numbers are bitwise Megatron's
unfused ones, compiled within an ulp: tests/test_swiglu.py). Measured with MKL as our ranks run it (2 cores,
[10240, 1, 2 x 768]): forward and backward 29.7 ms per layer unfused, 15.9 ms with the eager version of this
function, ~17 ms compiled inside a bf16 training step (torch.profiler; 19.6 ms eager there). It keeps only fc1's
output for backward, two [tokens, ffn] less than the unfused path.

`use_eager_swiglu` installs it where Megatron's MLP and shared experts look up `bias_swiglu_impl` and
`weighted_bias_swiglu_impl`, the functions `bias_activation_fusion` calls (models/gpt.py sets that flag everywhere;
on GPU Megatron's compiled kernels run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_mc.models.cpu_kernels import cpu_kernel


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return _forward(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return _backward(grad, y)


@cpu_kernel
def _forward(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, -1)
    return F.silu(gate) * up


@cpu_kernel
def _backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, -1)
    if torch.compiler.is_compiling():
        # Inductor runs aten's silu_backward as a kernel of its own, outside the fused loop; its formula fuses
        # ([11264, 1, 2 x 768]: bf16 20.5 -> 11.9 ms, fp32 28.2 -> 25.2)
        sigmoid = torch.sigmoid(gate)
        return torch.cat([grad * up * sigmoid * (1 + gate * (1 - sigmoid)), grad * gate * sigmoid], -1)
    # SiLU's own backward op: uncompiled, the numbers of autograd through Megatron's unfused SwiGLU
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], -1)


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
