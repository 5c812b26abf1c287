"""The batched torch_native attention of CPU SGLang servers (rollout/cpu_attention.py) against SGLang's own
per-request methods on the same KV cache: decode steps of requests of different lengths, prefills, and extends after
cached prefixes, with grouped-query heads, over one padded group or several. (The engine tests in test_rollout.py run
it inside the server against transformers.)"""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.rollout import cpu_attention

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 512


def _sglang():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    own = cpu_attention._per_request_decode or TorchNativeAttnBackend._run_sdpa_forward_decode
    own_extend = cpu_attention._per_request_extend or TorchNativeAttnBackend._run_sdpa_forward_extend
    return own, own_extend


def _cache(lengths, generator):
    """A KV cache whose requests sit at scattered slots (req_to_token rows in a shuffled pool order)."""
    k_cache, v_cache = (torch.randn(SLOTS, KV_HEADS, DIM, generator=generator) for _ in range(2))
    slots = torch.randperm(SLOTS - 1, generator=generator) + 1
    req_to_token = torch.zeros(8, 64, dtype=torch.int32)
    pools = torch.randperm(8, generator=generator)[:len(lengths)]
    used = 0
    for pool, n in zip(pools.tolist(), lengths):
        req_to_token[pool, :n] = slots[used:used + n].int()
        used += n
    return k_cache, v_cache, req_to_token, pools


@pytest.mark.parametrize("group_tokens", [1 << 16, 40])  # one group, or several
def test_decode_matches_sglang_per_request(monkeypatch, group_tokens):
    monkeypatch.setattr(cpu_attention, "GROUP_TOKENS", group_tokens)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 17, 1, 33, 17, 9]
    k_cache, v_cache, req_to_token, pools = _cache(lengths, g)
    query = torch.randn(len(lengths), HEADS, DIM, generator=g)
    seq_lens = torch.tensor(lengths)
    own, _ = _sglang()
    expected = own(None, query, torch.zeros_like(query), k_cache, v_cache, req_to_token, pools, seq_lens,
                   scaling=0.3, enable_gqa=True)
    got = cpu_attention.decode(None, query, torch.zeros_like(query), k_cache, v_cache, req_to_token, pools, seq_lens,
                               scaling=0.3, enable_gqa=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("prefixes", [[0, 0, 0, 0], [3, 0, 10, 1]])  # prefills; extends after cached prefixes
@pytest.mark.parametrize("group_tokens", [1 << 16, 40])
def test_extend_matches_sglang_per_request(monkeypatch, prefixes, group_tokens):
    monkeypatch.setattr(cpu_attention, "GROUP_TOKENS", group_tokens)
    g = torch.Generator().manual_seed(1)
    lengths = [7, 30, 12, 2]
    k_cache, v_cache, req_to_token, pools = _cache(lengths, g)
    new = [n - p for n, p in zip(lengths, prefixes)]
    query = torch.randn(sum(new), HEADS, DIM, generator=g)
    args = (k_cache, v_cache, req_to_token, pools, torch.tensor(lengths), torch.tensor(prefixes), torch.tensor(new))
    _, own = _sglang()
    expected = own(None, query, torch.zeros_like(query), *args, scaling=0.3, enable_gqa=True, causal=True)
    got = cpu_attention.extend(None, query, torch.zeros_like(query), *args, scaling=0.3, enable_gqa=True, causal=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
