"""RMSNorm as one autograd function, in place of the torch.nn.RMSNorm modules of Megatron's local layer spec on CPU.

Without apex, Megatron's local spec builds its norms with WrappedTorchNorm, i.e. torch.nn.RMSNorm, and on CPU torch
has no RMSNorm kernel: the forward is its composite (upcast, pow, mean, add, rsqrt, two multiplies, downcast) and the
backward is autograd through each of those ops. Here the forward runs the same ops and the backward is the closed
form (torch's own decomposition of _fused_rms_norm_backward), each one function over [rows, hidden], compiled into
one loop for large inputs (models/cpu_kernels.py): within an ulp of torch's (tests/test_norm.py). It saves the input
and the per-row reciprocal RMS, not the fp32 intermediates. Measured on the CPU (2 cores, forward and backward,
[10240, 1, 256]): torch's fp32 11-13 ms, bf16 16-18 ms; these functions compiled, 1.4 ms in bf16. A bf16 6.3M-parameter training step of 10240 tokens spends ~43 ms in its 17 norms (torch.profiler).
"""

from __future__ import annotations

import torch

from rlhf_mc.models.cpu_kernels import cpu_kernel


class _RMSNorm(torch.autograd.Function):
    # the kernels see [rows, hidden]: one compiled kernel for every leading shape (layers' [s, b, h], q/k norms')
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.size(-1))
        out, rstd = _forward(rows, weight, eps)
        ctx.save_for_backward(rows, rstd, weight)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, rstd, weight = ctx.saved_tensors
        grad_x, grad_weight = _backward(grad.reshape(rows.shape), rows, rstd, weight)
        return grad_x.view(grad.shape), grad_weight, None


@cpu_kernel
def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # computed in fp32 for bf16/fp16 input, in its own dtype otherwise (as the composite does)
    rstd = torch.rsqrt(x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True) + eps)
    return (x * rstd * weight).to(x.dtype), rstd  # x * rstd: in rstd's dtype


@cpu_kernel
def _backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    x_hat = x * rstd
    grad_x_hat = grad * weight.to(rstd.dtype)
    grad_weight = (grad * x_hat).sum(0).to(weight.dtype)
    dot = (x_hat * grad_x_hat).sum(-1, keepdim=True)
    grad_x = (grad_x_hat - x_hat * (dot / x.size(-1))) * rstd
    return grad_x.to(x.dtype), grad_weight


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
