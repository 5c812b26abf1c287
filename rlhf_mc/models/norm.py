"""RMSNorm as one autograd function, in place of the torch.nn.RMSNorm modules of Megatron's local layer spec on CPU.

Without apex, Megatron's local spec builds its norms with WrappedTorchNorm, i.e. torch.nn.RMSNorm, and on CPU torch
has no RMSNorm kernel: the forward is its composite (upcast, pow, mean, add, rsqrt, two multiplies, downcast) and the
backward is autograd through each of those ops. Here the forward runs the same ops in the same order (bitwise the
same output) and the backward is the closed form (torch's own decomposition of _fused_rms_norm_backward): the input
gradient within an ulp of autograd's, the weight gradient bitwise (tests/test_norm.py). It saves the input and the
per-row reciprocal RMS, not the fp32 intermediates. Measured on the CPU (2 cores, forward and backward): [4080, 1,
256] fp32 3.7-6.8 -> 2.1-2.9 ms, bf16 3.5-3.9 -> 2.6-3.2 ms; [10240, 1, 256] fp32 11-13 -> 6-9 ms, bf16 16-18 ->
9-11 ms; a whole 6.3M-parameter update (256 x 40 tokens, one process, medians of 12 interleaved) fp32 2.29 -> 2.24 s,
bf16 1.47 -> 1.40 s.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # computed in fp32 for bf16/fp16 input, in its own dtype otherwise (as the composite does)
        rstd = torch.rsqrt(x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        return (x * rstd).mul_(weight).to(x.dtype)  # x * rstd: in rstd's dtype

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x * rstd
        grad_x_hat = grad * weight.to(rstd.dtype)
        grad_weight = (grad * x_hat).sum(tuple(range(x.dim() - 1))).to(weight.dtype)
        dot = (x_hat * grad_x_hat).sum(-1, keepdim=True)
        grad_x = grad_x_hat.sub_(x_hat.div_(x.size(-1)).mul_(dot)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm over the last dimension with a weight, taking over an existing module's parameter."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def use_fused_rms_norm(model: torch.nn.Module) -> None:
    """Replaces every torch.nn.RMSNorm in `model` (its layers' norms, query/key norms, the final norm) that
    normalizes the last dimension with a weight and a given epsilon by RMSNorm, keeping the parameter object."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (type(child) is torch.nn.RMSNorm and child.weight is not None and child.eps is not None
                    and len(child.normalized_shape) == 1):
                setattr(module, name, RMSNorm(child.weight, child.eps))
