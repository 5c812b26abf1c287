"""Batched attention for SGLang's torch_native backend, the one its CPU servers run without Intel AMX.

SGLang 0.5.23's TorchNativeAttnBackend attends one request at a time ("TODO: this loop process a sequence per
iter, this is inefficient"): in every layer of every decode step, a KV gather and an SDPA call per running request.
An RL rollout runs hundreds of requests at once (32 prompts x 8 samples), so decode time went to that loop rather
than to the model. Here the requests are sorted by length and attended in padded groups, one masked SDPA call per
group, each group's padded KV within GROUP_TOKENS (a long request is a group alone). The patch replaces the two
per-request methods on the class (rollout/cpu_site/sitecustomize.py installs it in the server's processes); calls
with what it was not written for (encoder-decoder, sliding windows) go to SGLang's own.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

GROUP_TOKENS = 1 << 16  # padded KV positions per SDPA call (x heads x head dim x 4 bytes, for K and for V)
MASK_ELEMENTS = 1 << 24  # an extend's explicit mask (requests with a cached prefix), booleans per SDPA call


def _groups(lengths: torch.Tensor, budget: int = GROUP_TOKENS) -> list[torch.Tensor]:
    """Request indices sorted by length, cut into groups whose count x longest length stays within `budget` (a
    request longer than that is a group alone)."""
    order = torch.argsort(lengths, descending=True)
    sorted_lengths = lengths[order].tolist()
    groups, start = [], 0
    while start < len(sorted_lengths):
        size = max(1, budget // max(sorted_lengths[start], 1))
        groups.append(order[start:start + size])
        start += size
    return groups


def _padded_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, pools: torch.Tensor,
               longest: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, kv_heads, longest, d] of the requests' cached keys and values (entries past a request's length: garbage,
    masked out by the caller)."""
    slots = req_to_token[pools, :longest]
    # index_select over the flat slots: 5x faster than indexing with the 2-D slots (256 x 72 of a 65536-slot cache)
    k, v = (cache.index_select(0, slots.flatten()).unflatten(0, slots.shape) for cache in (k_cache, v_cache))
    return k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)


def decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens=None,
           scaling=None, enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
    """TorchNativeAttnBackend._run_sdpa_forward_decode: query/output [requests, heads, d], one new token each."""
    if encoder_lens is not None or sliding_window_size is not None:
        return _per_request_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                   encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
    for group in _groups(seq_lens):
        lengths = seq_lens[group]
        longest = int(lengths[0])
        k, v = _padded_kv(k_cache, v_cache, req_to_token, req_pool_indices[group], longest, query.dtype)
        mask = torch.arange(longest, device=query.device) < lengths[:, None]  # [n, longest]
        out = scaled_dot_product_attention(query[group].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                           scale=scaling, enable_gqa=enable_gqa)  # [n, heads, 1, d]
        output[group] = out[:, :, 0]
    return output


def extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
           extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
           sliding_window_size=None):
    """TorchNativeAttnBackend._run_sdpa_forward_extend: query/output [new tokens of all requests, heads, d]; request
    i's extend_seq_lens[i] new tokens follow its extend_prefix_lens[i] cached ones (seq_lens[i] in all)."""
    if encoder_lens is not None or sliding_window_size is not None or not causal:
        return _per_request_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                   extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                                   is_cross_attn, sliding_window_size)
    starts = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens  # each request's first row in query/output
    # Prefills (no cached prefix) need no mask: queries and keys both start at position 0, SDPA's is_causal is
    # the causal mask (a padding row past a request's end is never read back). With cached prefixes, the explicit
    # mask [n, new, longest] is bounded by MASK_ELEMENTS through the group size.
    prefill = not bool(extend_prefix_lens.any())
    budget = GROUP_TOKENS if prefill else max(1, min(GROUP_TOKENS, MASK_ELEMENTS // int(extend_seq_lens.max())))
    for group in _groups(seq_lens, budget):
        lengths, new, prefix = seq_lens[group], extend_seq_lens[group], extend_prefix_lens[group]
        longest, most_new = int(lengths[0]), int(new.max())
        k, v = _padded_kv(k_cache, v_cache, req_to_token, req_pool_indices[group], longest, query.dtype)
        j = torch.arange(most_new, device=query.device)
        real = j < new[:, None]  # [n, most_new]: which padded query rows are tokens
        rows = (starts[group, None] + j).clamp(max=query.size(0) - 1)  # padding rows read some token, unused
        q = query[rows].transpose(1, 2)  # [n, heads, most_new, d]
        if prefill:
            out = scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=enable_gqa)
        else:
            q_pos = prefix[:, None] + j  # each new token's position in its sequence
            mask = torch.arange(longest, device=query.device)[None, None, :] <= q_pos[:, :, None]
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scaling,
                                               enable_gqa=enable_gqa)
        output[rows[real]] = out.transpose(1, 2)[real]
    return output


def install(backend_class) -> None:
    """Replaces TorchNativeAttnBackend's per-request attention by the batched one (idempotent)."""
    global _per_request_decode, _per_request_extend
    if backend_class._run_sdpa_forward_decode is not decode:
        _per_request_decode = backend_class._run_sdpa_forward_decode
        _per_request_extend = backend_class._run_sdpa_forward_extend
        backend_class._run_sdpa_forward_decode = decode
        backend_class._run_sdpa_forward_extend = extend


_per_request_decode = _per_request_extend = None  # SGLang's own, set by install()
