"""The CPU SwiGLU (models/swiglu.py) against Megatron's unfused SwiGLU: bitwise the same outputs and input gradients
(within an ulp where a large input runs compiled, models/cpu_kernels.py), alone and inside a Megatron model built by
build_model (where it must be the function that runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.models.swiglu import bias_swiglu, weighted_bias_swiglu
from rlhf_mc.runtime.spawn import spawn

CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"


def _megatron_unfused(y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """megatron.core.transformer.mlp.MLP.forward without bias_activation_fusion (glu_linear_offset 0.0; `weights`:
    its per_token_scale, unsqueezed)."""
    if bias is not None:
        y = y + bias
    gate, up = torch.chunk(y, 2, dim=-1)
    out = F.silu(gate) * (up + 0.0)
    return out if weights is None else (out * weights).to(y.dtype)


@pytest.mark.parametrize("shape", [(37, 1, 2 * 24), (5, 3, 2 * 16), (11, 2 * 8)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])  # an MoE expert's MLP: scaled by fp32 routing probabilities
def test_swiglu_is_megatrons_unfused_bitwise(shape, with_bias, dtype, weighted):
    g = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    y = (3 * torch.randn(shape, generator=g)).to(dtype)
    bias = torch.randn(shape[-1], generator=g).to(dtype) if with_bias else None
    weights = torch.rand(*shape[:-1], 1, generator=g) if weighted else None
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    results = []
    for fn in (_megatron_unfused, weighted_bias_swiglu if weighted else bias_swiglu):
        x = y.clone().requires_grad_()
        b = bias.clone().requires_grad_() if with_bias else None
        w = weights.clone().requires_grad_() if weighted else None
        out = fn(x, b, w) if weighted else fn(x, b)
        out.backward(grad)
        results.append((out, x.grad, b.grad if with_bias else None, w.grad if weighted else None))
    (out_ref, dx_ref, db_ref, dw_ref), (out, dx, db, dw) = results
    assert out.dtype == dtype and torch.equal(out, out_ref)
    assert torch.equal(dx, dx_ref)
    assert not with_bias or torch.equal(db, db_ref)
    assert not weighted or torch.equal(dw, dw_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_swiglu_of_a_large_input_within_an_ulp(dtype):
    # [1024, 1, 2 x 512]: the gradient has 2^19 >= COMPILE_FROM elements, both kernels run compiled; they round once
    g = torch.Generator().manual_seed(3)
    y = (3 * torch.randn(1024, 1, 1024, generator=g)).to(dtype)
    grad = torch.randn(1024, 1, 512, generator=g).to(dtype)
    results = []
    for fn in (_megatron_unfused, bias_swiglu):
        x = y.clone().requires_grad_()
        out = fn(x, None)
        out.backward(grad)
        results.append((out.detach(), x.grad))
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)
    for ours, megatron in zip(results[1], results[0]):  # (slack where SiLU's derivative cancels to ~0)
        assert ((ours - megatron).abs() <= 2 * ulp * megatron.abs() + ulp * megatron.abs().max() / 8).all()


def _made_by(t: torch.Tensor) -> set[str]:
    """The autograd nodes that made `t`, and the ones before them (an expert's SwiGLU is then scaled)."""
    return {type(t.grad_fn).__name__} | {type(f).__name__ for f, _ in t.grad_fn.next_functions if f is not None}


def _model_forward_backward(model_yaml: str) -> dict:
    from megatron.core.transformer import mlp

    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.models.swiglu import _SwiGLU
    from rlhf_mc.runtime import init_parallel

    config = ModelConfig.from_yaml(CONFIGS / model_yaml)
    init_parallel(ParallelConfig(), seed=5)
    (model,) = build_model(config, ParallelConfig())
    seen = []  # how each MLP's activation output was made
    for module in model.modules():
        if isinstance(module, mlp.MLP):
            module.linear_fc2.register_forward_pre_hook(lambda _, args: seen.append(_made_by(args[0])))
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(24).expand(2, 24)
    runs = {}
    for fused in (True, False):  # build_model's setting (ours on CPU), then Megatron's unfused path
        for module in model.modules():  # MoE layers hold copies of the config
            if getattr(module, "config", None) is not None:
                module.config.bias_activation_fusion = fused
        seen.clear()
        model.zero_grad()
        logits = model(tokens, position_ids, attention_mask=None)
        (logits.float().sin().sum()).backward()
        runs[fused] = {"logits": logits.detach(), "activations": list(seen),
                       "grads": [p.grad.clone() for p in model.parameters() if p.grad is not None]}
    return {"ours": runs[True], "unfused": runs[False], "swiglu_backward": _SwiGLU.__name__ + "Backward"}


@pytest.mark.parametrize("model_yaml", ["tiny-llama.yaml", "tiny-qwen3-moe.yaml"])  # dense MLPs; experts' MLPs
def test_build_model_runs_it_and_matches_megatrons_unfused(model_yaml):
    (result,) = spawn(_model_forward_backward, 1, model_yaml)
    ours, unfused = result["ours"], result["unfused"]
    assert ours["activations"] and all(result["swiglu_backward"] in made for made in ours["activations"])
    assert len(unfused["activations"]) == len(ours["activations"])
    assert not any(result["swiglu_backward"] in made for made in unfused["activations"])
    assert torch.equal(ours["logits"], unfused["logits"])
    assert len(ours["grads"]) == len(unfused["grads"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(ours["grads"], unfused["grads"]))
