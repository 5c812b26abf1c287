"""Log-probs and entropy of target tokens from vocab-parallel (TP-sharded) logits, never gathering the vocabulary.

logits: [..., vocab / tp] on each TP rank (Megatron's parallel_output); targets: [...] global token ids.
Temperature is applied exactly as the rollout engine does: log_softmax(logits / temperature) (see
rollout/base.py); temperature 0 means greedy there, and the raw logits here (temperature 1).

One autograd function with its own backward (as Megatron's vocab-parallel cross-entropy has), over chunks of tokens
so the fp32 buffers stay bounded (bf16 logits are upcast and divided by the temperature a chunk at a time). Forward
keeps per token only log Z (and the entropy); backward recomputes each chunk's softmax from the saved logits into
the gradient's own buffer: d log p(y) / dz = onehot(y) - p, d H / dz = -p (log p + H). Against torch's log_softmax
with activation checkpointing (the softmax recomputed, its backward, the gather's zero-filled scatter) this is about
half the passes over the [tokens, vocab] buffer, the largest of a small model's step (SmolLM2-135M's 49k vocabulary:
bench/update_step.py --profile; docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _TokenLogProbs(torch.autograd.Function):
    """(log p(target), entropy) per token of 2-D `logits`, the softmax of z = logits / temperature over a
    vocabulary whose slice from `vocab_start` this rank holds (`group`: the ranks holding the rest; None: all of it
    here). Every TP rank computes the same values and gets the same upstream gradient; each rank's gradient is that
    of its own slice, so the backward needs no communication. One fp32 buffer of a chunk's size at a time, in
    either direction (bf16 logits are upcast into it)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, vocab_start: int, group, chunk_tokens: int,
                with_entropy: bool):
        n, local_vocab = logits.shape
        logz = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_z = torch.empty_like(logz)
        entropy = torch.empty_like(logz) if with_entropy else None
        local_ids = targets - vocab_start
        owned = (local_ids >= 0) & (local_ids < local_vocab)
        local_ids = local_ids.clamp(0, local_vocab - 1)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            chunk = logits[s:e]
            # the max only stabilizes the exponent (of the raw logits: the temperature is positive)
            m = _all_reduce(chunk.max(dim=-1).values.float(), group, dist.ReduceOp.MAX)
            # upcast into a buffer of its own first: an op mixing bf16 and fp32 operands casts into a temporary
            exp = chunk.to(torch.float32, copy=True).sub_(m.unsqueeze(-1))
            if temperature != 1.0:
                exp.div_(temperature)
            sum_exp = exp.exp_().sum(dim=-1)
            picked = torch.where(owned[s:e], chunk.gather(-1, local_ids[s:e].unsqueeze(-1)).squeeze(-1).float(), 0.0)
            sums = [sum_exp, picked]
            if with_entropy:  # H = log Z - sum_v p_v z_v
                sums.append(exp.mul_(chunk).sum(dim=-1))
            sums = _all_reduce(torch.stack(sums), group)
            logz[s:e] = m / temperature + sums[0].log()
            target_z[s:e] = sums[1] / temperature
            if with_entropy:
                entropy[s:e] = logz[s:e] - sums[2] / (temperature * sums[0])
        ctx.save_for_backward(logits, local_ids, owned, logz, entropy if with_entropy else logz)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)
        return target_z - logz, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_ids, owned, logz, entropy = ctx.saved_tensors
        temperature, n = ctx.temperature, logits.size(0)
        grad = torch.empty_like(logits)
        in_place = grad.dtype == torch.float32  # fp32 logits: the gradient's own rows are the buffer

        def z_of(s, e, out=None):
            z = out if out is not None else torch.empty(e - s, logits.size(1), device=logits.device)
            z.copy_(logits[s:e])
            return z.div_(temperature) if temperature != 1.0 else z

        for s in range(0, n, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, n)
            # d/dz = -p * c + onehot(y) * grad_logprobs, c = grad_logprobs + grad_entropy * (log p + H) per element
            g = z_of(s, e, grad[s:e] if in_place else None).sub_(logz[s:e].unsqueeze(-1)).exp_()  # p
            if grad_entropy is not None:
                c = z_of(s, e).sub_((logz[s:e] - entropy[s:e]).unsqueeze(-1)).mul_(grad_entropy[s:e].unsqueeze(-1))
                if grad_logprobs is not None:
                    c.add_(grad_logprobs[s:e].unsqueeze(-1))
                g.mul_(c).neg_()
            else:
                g.mul_(-grad_logprobs[s:e].unsqueeze(-1))
            if grad_logprobs is not None:
                rows = owned[s:e].nonzero().squeeze(-1)
                g[rows, local_ids[s:e][rows]] += grad_logprobs[s:e][rows]
            if temperature != 1.0:
                g.div_(temperature)
            if not in_place:
                grad[s:e] = g
        return grad, None, None, None, None, None, None


# fp32 elements of one chunk's buffers (each 1 GB): 1766 tokens of a 152k vocabulary, every token of a small one at
# once
CHUNK_ELEMENTS = 2**28


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group=None, temperature: float = 1.0,
                            with_entropy: bool = False, chunk_tokens: int | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy or None), each shaped like `targets`, in fp32. `chunk_tokens`: tokens a chunk, by
    default as many as CHUNK_ELEMENTS allows."""
    if temperature <= 0:
        temperature = 1.0
    chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // logits.size(-1))
    sharded = tp_group is not None and dist.get_world_size(tp_group) > 1
    vocab_start = dist.get_rank(tp_group) * logits.size(-1) if sharded else 0
    logprobs, entropy = _TokenLogProbs.apply(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), temperature,
                                             vocab_start, tp_group if sharded else None, chunk_tokens, with_entropy)
    return logprobs.reshape(targets.shape), entropy.reshape(targets.shape) if with_entropy else None
