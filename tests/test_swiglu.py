"""The CPU SwiGLU (models/swiglu.py) against Megatron's unfused SwiGLU: bitwise the same outputs and input gradients,
alone and inside a Megatron model built by build_model (where it must be the function that runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.models.swiglu import bias_swiglu
from rlhf_mc.runtime.spawn import spawn

MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-llama.yaml")


def _megatron_unfused(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """megatron.core.transformer.mlp.MLP.forward without bias_activation_fusion (glu_linear_offset 0.0)."""
    if bias is not None:
        y = y + bias
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)


@pytest.mark.parametrize("shape", [(37, 1, 2 * 24), (5, 3, 2 * 16), (11, 2 * 8)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_megatrons_unfused_bitwise(shape, with_bias, dtype):
    g = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    y = (3 * torch.randn(shape, generator=g)).to(dtype)
    bias = torch.randn(shape[-1], generator=g).to(dtype) if with_bias else None
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    results = []
    for fn in (_megatron_unfused, bias_swiglu):
        x = y.clone().requires_grad_()
        b = bias.clone().requires_grad_() if with_bias else None
        out = fn(x, b)
        out.backward(grad)
        results.append((out, x.grad, b.grad if with_bias else None))
    (out_ref, dx_ref, db_ref), (out, dx, db) = results
    assert torch.equal(out, out_ref)
    assert torch.equal(dx, dx_ref)
    assert not with_bias or torch.equal(db, db_ref)


def _model_forward_backward() -> dict:
    from megatron.core.transformer import mlp

    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.models.swiglu import _SwiGLU
    from rlhf_mc.runtime import init_parallel

    init_parallel(ParallelConfig(), seed=5)
    (model,) = build_model(MODEL, ParallelConfig())
    seen = []  # how each MLP's activation output was made
    for module in model.modules():
        if isinstance(module, mlp.MLP):
            module.linear_fc2.register_forward_pre_hook(lambda _, args: seen.append(type(args[0].grad_fn).__name__))
    tokens = torch.randint(0, MODEL.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(24).expand(2, 24)
    runs = {}
    for fused in (True, False):  # build_model's setting (ours on CPU), then Megatron's unfused path
        model.config.bias_activation_fusion = fused
        seen.clear()
        model.zero_grad()
        logits = model(tokens, position_ids, attention_mask=None)
        (logits.float().sin().sum()).backward()
        runs[fused] = {"logits": logits.detach(), "grads": [p.grad.clone() for p in model.parameters()],
                       "activations": list(seen)}
    return {"ours": runs[True], "unfused": runs[False], "swiglu_backward": _SwiGLU.__name__ + "Backward"}


def test_build_model_runs_it_and_matches_megatrons_unfused():
    (result,) = spawn(_model_forward_backward, 1)
    ours, unfused = result["ours"], result["unfused"]
    assert ours["activations"] == [result["swiglu_backward"]] * MODEL.num_layers
    assert unfused["activations"] == ["MulBackward0"] * MODEL.num_layers
    assert torch.equal(ours["logits"], unfused["logits"])
    assert all(torch.equal(a, b) for a, b in zip(ours["grads"], unfused["grads"]))
