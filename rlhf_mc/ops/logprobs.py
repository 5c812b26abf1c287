"""Log-probs and entropy of target tokens from vocab-parallel (TP-sharded) logits, never gathering the vocabulary.

logits: [..., vocab / tp] on each TP rank (Megatron's parallel_output); targets: [...] global token ids.
Temperature is applied exactly as the rollout engine does: log_softmax(logits / temperature) (see
rollout/base.py); temperature 0 means greedy there, and the raw logits here (temperature 1).
Work is chunked over tokens so the fp32 softmax buffers stay bounded (bf16 logits are upcast and
divided by the temperature a chunk at a time); with gradients each chunk is recomputed in backward (activation
checkpointing) instead of keeping its buffers.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


class _AllReduce(torch.autograd.Function):
    """Sum over the TP group in forward; the gradient of a sum of replicas is the gradient itself (each rank's
    input contributes to every rank's output, and every rank backpropagates the same upstream gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sharded_chunk(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, temperature: float, *,
                   vocab_start: int, group):
    """One chunk's (log-probs, entropy) where `group`'s ranks each hold a slice of the vocabulary from `vocab_start`."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # The max only stabilizes the exponent; no gradient flows through it.
    local_max = logits.detach().max(dim=-1).values
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _AllReduce.apply(exp.sum(dim=-1), group)
    log_z = sum_exp.log()
    local_ids = targets - vocab_start
    owned = (local_ids >= 0) & (local_ids < logits.size(-1))
    picked = shifted.gather(-1, local_ids.clamp(0, logits.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _AllReduce.apply(torch.where(owned, picked, torch.zeros_like(picked)), group)
    logprobs = target_logit - log_z
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    # H = log Z - sum_v p_v * shifted_v
    expected = _AllReduce.apply((exp * shifted).sum(dim=-1), group) / sum_exp
    return logprobs, log_z - expected


def _whole_vocabulary_chunk(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, temperature: float):
    """_sharded_chunk where this rank holds the whole vocabulary: torch's fused log_softmax (upcasting inside the
    kernel) in place of the five passes the sharded vocabulary needs; ~3x faster at 8192 tokens x 1024 (4.2 vs 11.8
    ms, 11 vs 32 ms with the backward, bf16 logits on 2 cores)."""
    logp = torch.log_softmax(logits if temperature == 1.0 else logits.float() / temperature, -1, dtype=torch.float32)
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    return logprobs, -(logp.exp() * logp).sum(-1)


# fp32 elements of one chunk's buffers (logits, shifted, exp: each 1 GB): 1766 tokens of a 152k vocabulary, every
# token of a small one at once
CHUNK_ELEMENTS = 2**28


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group=None, temperature: float = 1.0,
                            with_entropy: bool = False, chunk_tokens: int | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy or None), each shaped like `targets`, in fp32. `chunk_tokens`: tokens a chunk, by
    default as many as CHUNK_ELEMENTS allows."""
    if temperature <= 0:
        temperature = 1.0
    chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // logits.size(-1))
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        chunk = functools.partial(_sharded_chunk, vocab_start=dist.get_rank(tp_group) * logits.size(-1),
                                  group=tp_group)
    else:
        chunk = _whole_vocabulary_chunk
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_targets = targets.reshape(-1)
    outs = []
    for start in range(0, flat_targets.numel(), chunk_tokens):
        args = (flat_logits[start:start + chunk_tokens], flat_targets[start:start + chunk_tokens], with_entropy,
                temperature)
        if torch.is_grad_enabled() and flat_logits.requires_grad:
            outs.append(checkpoint(chunk, *args, use_reentrant=False))
        else:
            outs.append(chunk(*args))
    logprobs = torch.cat([o[0] for o in outs]).reshape(targets.shape)
    entropy = torch.cat([o[1] for o in outs]).reshape(targets.shape) if with_entropy else None
    return logprobs, entropy
