"""The local core attention on packed (THD) input against SDPA run on each sequence alone: outputs and the
gradients of query, key and value, for a pack in no particular order with runs of equal lengths (attended as one
batch) between single sequences. In bf16 with gradients on CPU (attended in fp32 there, for speed), within bf16's
rounding of the same in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.runtime.spawn import spawn

MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-llama.yaml")
LENGTHS = [30, 9, 9, 9, 21, 19, 19, 7, 30]


def _packed_vs_alone(dtype: torch.dtype) -> list[float]:
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    init_parallel(ParallelConfig())
    (model,) = build_model(MODEL, ParallelConfig())
    attention = model.decoder.layers[0].self_attention.core_attention
    heads, groups, d = MODEL.num_attention_heads, MODEL.num_kv_heads, MODEL.head_dim
    g = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
               for h in (heads, groups, groups))
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).int()
    out = attention(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                                      cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                                                                      max_seqlen_kv=max(LENGTHS)))
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    packed = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    reference = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (x.detach().to(reference).requires_grad_() for x in (q, k, v))
    grad_out = grad_out.to(reference)
    alone = []
    for qs, ks, vs in zip(q.split(LENGTHS), k.split(LENGTHS), v.split(LENGTHS)):
        alone.append(F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                    is_causal=True, enable_gqa=True).transpose(0, 1).flatten(1))
    expected = torch.cat(alone)
    expected = (expected, *torch.autograd.grad(expected, (q, k, v), grad_out))
    # each error relative to the largest entry of its tensor
    return [((a.to(reference) - b).abs().max() / b.abs().max()).item() for a, b in zip(packed, expected)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.bfloat16, 2.0 ** -8)])
def test_packed_attention_matches_each_sequence_alone(dtype, tolerance):
    (errors,) = spawn(_packed_vs_alone, 1, dtype)
    assert max(errors) < tolerance, errors  # output, dq, dk, dv
