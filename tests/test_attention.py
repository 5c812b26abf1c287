"""The local core attention on packed (THD) input against SDPA run on each sequence alone: outputs and the
gradients of query, key and value, for a pack in no particular order with runs of equal lengths (attended as one
batch) between single sequences. In bf16 with gradients on CPU (attended in fp32 there, for speed), within bf16's
rounding of the same in fp32. Without gradients on CPU the pack takes models/cpu_causal_attention.py's kernel: its
output against SDPA's in fp64, with lengths on both sides of its 64-query and 512-key blocks, query, key and value
strided views of one tensor as Megatron's projection gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.runtime.spawn import spawn

MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-llama.yaml")
LENGTHS = [30, 9, 9, 9, 21, 19, 19, 7, 30]
# the no-gradient kernel's blocks: 64 queries, 512 keys
KERNEL_LENGTHS = [1, 63, 64, 65, 130, 9, 9, 512, 513, 1100, 2]


def _packed_vs_alone(dtype: torch.dtype, lengths: list[int], with_grad: bool) -> list[float]:
    """Errors of the packed attention's output (and with_grad: of dq, dk, dv) against SDPA on each sequence alone
    in fp64 (fp32 for bf16 with gradients, where SDPA's fp64 backward would be the slow part), each relative to the
    largest entry of its tensor."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlhf_mc.models import cpu_causal_attention
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    init_parallel(ParallelConfig())
    (model,) = build_model(MODEL, ParallelConfig())
    attention = model.decoder.layers[0].self_attention.core_attention
    heads, groups, d = MODEL.num_attention_heads, MODEL.num_kv_heads, MODEL.head_dim
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(lengths), heads + 2 * groups, d, generator=g, dtype=torch.float64).to(dtype)
    if with_grad:
        q, k, v = (x.contiguous().requires_grad_() for x in qkv.split([heads, groups, groups], 1))
    else:
        q, k, v = qkv.split([heads, groups, groups], 1)
        assert not q.is_contiguous() and cpu_causal_attention.applies(q) == (dtype != torch.float64)
    cu = torch.tensor([0, *lengths]).cumsum(0).int()
    with torch.set_grad_enabled(with_grad):
        out = attention(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                                          cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                                                                          max_seqlen_kv=max(lengths)))
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    packed = (out, *torch.autograd.grad(out, (q, k, v), grad_out)) if with_grad else (out,)
    reference = torch.float32 if dtype == torch.bfloat16 and with_grad else torch.float64
    q, k, v = (x.detach().to(reference).requires_grad_(with_grad) for x in (q, k, v))
    alone = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        alone.append(F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                    is_causal=True, enable_gqa=True).transpose(0, 1).flatten(1))
    expected = torch.cat(alone)
    if with_grad:
        expected = (expected, *torch.autograd.grad(expected, (q, k, v), grad_out.to(reference)))
    else:
        expected = (expected,)
    return [((a.to(reference) - b).abs().max() / b.abs().max()).item() for a, b in zip(packed, expected)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.bfloat16, 2.0 ** -8)])
def test_packed_attention_matches_each_sequence_alone(dtype, tolerance):
    (errors,) = spawn(_packed_vs_alone, 1, dtype, LENGTHS, True)
    assert max(errors) < tolerance, errors  # output, dq, dk, dv


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -8),
                                              (torch.float64, 1e-12)])  # fp64: SDPA, the kernel has no fp64
def test_packed_attention_without_gradients_matches_each_sequence_alone(dtype, tolerance):
    (errors,) = spawn(_packed_vs_alone, 1, dtype, KERNEL_LENGTHS, False)
    assert max(errors) < tolerance, errors


def test_te_specs_of_fp32_models_take_our_core_attention(monkeypatch):
    """Transformer Engine has no attention backend for fp32 with packed (THD) input: an fp32 model with TE's layer
    spec takes our core attention, a bf16 one keeps TE's. TE does not import here: its spec is stood in for by
    Megatron's local one, whose core attention (DotProductAttention) plays TE's."""
    from types import SimpleNamespace

    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rlhf_mc.models.attention import LocalCoreAttention
    from rlhf_mc.models.gpt import layer_spec

    stand_in = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=MODEL.qk_norm, normalization="RMSNorm")
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda qk_layernorm: stand_in)

    def core_attention(spec):
        return spec.submodules.self_attention.submodules.core_attention

    assert core_attention(layer_spec(MODEL, True, SimpleNamespace(bf16=False, fp16=False), None)) is LocalCoreAttention
    assert core_attention(layer_spec(MODEL, True, SimpleNamespace(bf16=True, fp16=False), None)) is DotProductAttention
    assert core_attention(layer_spec(MODEL, False, SimpleNamespace(bf16=True, fp16=False), None)) is LocalCoreAttention
