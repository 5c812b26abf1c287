"""The local core attention on packed (THD) input against SDPA run on each sequence alone: outputs and the
gradients of query, key and value, for a pack in no particular order with runs of equal lengths (attended as one
batch) between single sequences."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.runtime.spawn import spawn

MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-llama.yaml")
LENGTHS = [30, 9, 9, 9, 21, 19, 19, 7, 30]


def _packed_vs_alone() -> list[float]:
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    init_parallel(ParallelConfig())
    (model,) = build_model(MODEL, ParallelConfig())
    attention = model.decoder.layers[0].self_attention.core_attention
    heads, groups, d = MODEL.num_attention_heads, MODEL.num_kv_heads, MODEL.head_dim
    g = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, groups, groups))
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).int()
    out = attention(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                                      cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                                                                      max_seqlen_kv=max(LENGTHS)))
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    packed = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    alone = []
    for qs, ks, vs in zip(q.split(LENGTHS), k.split(LENGTHS), v.split(LENGTHS)):
        alone.append(F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                    is_causal=True, enable_gqa=True).transpose(0, 1).flatten(1))
    expected = torch.cat(alone)
    expected = (expected, *torch.autograd.grad(expected, (q, k, v), grad_out))
    return [(a - b).abs().max().item() for a, b in zip(packed, expected)]


def test_packed_attention_matches_each_sequence_alone():
    (errors,) = spawn(_packed_vs_alone, 1)
    assert max(errors) < 1e-12, errors  # output, dq, dk, dv
