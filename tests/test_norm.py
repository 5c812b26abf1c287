"""The one-function RMSNorm (models/norm.py) against torch.nn.RMSNorm, the module Megatron's local spec builds: the
output, input gradient and weight gradient within an ulp (the input gradient is the closed form, torch's is autograd
through the composite; in float64 the two agree to 1e-12; a large input runs compiled, models/cpu_kernels.py, and
rounds once), alone and inside a model built by build_model, where every norm must be ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.models.norm import RMSNorm
from rlhf_mc.runtime.spawn import spawn

CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"


def _both(shape, dtype, eps=1e-6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    reference = torch.nn.RMSNorm(shape[-1], eps=eps, dtype=dtype)
    results = []
    for norm in (reference, RMSNorm(torch.nn.Parameter(weight.clone()), eps)):
        with torch.no_grad():
            norm.weight.copy_(weight)
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        results.append((out, xi.grad, norm.weight.grad))
    return results


# [t, b, hidden]; per-head q/k norms; 2^19 >= COMPILE_FROM elements (compiled)
@pytest.mark.parametrize("shape", [(37, 1, 24), (5, 3, 16), (9, 40), (2048, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(shape, dtype):
    (out_ref, dx_ref, dw_ref), (out, dx, dw) = _both(shape, dtype)
    assert out.dtype == dx.dtype == dw.dtype == dtype
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)  # relative spacing of the dtype's numbers
    for ours, reference in ((out, out_ref), (dx, dx_ref)):
        assert ((ours - reference).abs() <= ulp * reference.abs() + 1e-6 * reference.abs().max()).all(), \
            (ours - reference).abs().max()
    # the weight gradient sums over the rows, in another order when compiled
    assert (dw - dw_ref).abs().max() <= 1e-5 * dw_ref.abs().max() if dtype == torch.float32 else torch.equal(dw, dw_ref)


def test_rms_norm_backward_is_the_exact_gradient():
    (out_ref, dx_ref, dw_ref), (out, dx, dw) = _both((33, 2, 48), torch.float64, eps=1e-5, seed=1)
    assert (out - out_ref).abs().max() < 1e-14
    assert (dx - dx_ref).abs().max() < 1e-12 and (dw - dw_ref).abs().max() < 1e-12


def _model_with_both_norms(model_yaml: str) -> dict:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    config = ModelConfig.from_yaml(CONFIGS / model_yaml)
    init_parallel(ParallelConfig(), seed=5)
    (model,) = build_model(config, ParallelConfig())
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, (RMSNorm, torch.nn.RMSNorm))]
    with torch.no_grad():  # weights away from 1, so that a wrong weight gradient shows
        for _, _, norm in slots:
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(slots)))
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(24).expand(2, 24)
    runs = {}
    for kind in ("ours", "torch"):
        if kind == "torch":
            for parent, name, norm in slots:
                reference = torch.nn.RMSNorm(norm.weight.numel(), eps=norm.eps)
                reference.weight = norm.weight
                setattr(parent, name, reference)
        model.zero_grad()
        logits = model(tokens, position_ids, attention_mask=None)
        logits.float().sin().sum().backward()
        runs[kind] = {"logits": logits.detach(), "grads": [p.grad.clone() for p in model.parameters()]}
    return {"kinds": sorted({type(n).__module__ + "." + type(n).__name__ for _, _, n in slots}), "norms": len(slots),
            **runs}


def test_build_model_uses_it_everywhere():
    # tiny-qwen3 has per-head query/key norms besides the layers' and the final one
    (result,) = spawn(_model_with_both_norms, 1, "tiny-qwen3.yaml")
    config = ModelConfig.from_yaml(CONFIGS / "tiny-qwen3.yaml")
    assert result["kinds"] == ["rlhf_mc.models.norm.RMSNorm"]
    assert result["norms"] == 4 * config.num_layers + 1
    ours, reference = result["ours"], result["torch"]
    # through the layers, an ulp here and there in the norms: compare the logits and each gradient as a whole
    assert ((ours["logits"] - reference["logits"]).norm() / reference["logits"].norm()).item() < 1e-6
    assert max(((a - b).norm() / b.norm()).item() for a, b in zip(ours["grads"], reference["grads"])) < 1e-5
