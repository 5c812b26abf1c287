"""Vocab-parallel log-probs and entropy against torch's log_softmax on the full vocabulary (values and gradients),
single process and TP=2 (gloo), with temperature and chunking."""

from __future__ import annotations

import torch

from rlhf_mc.ops.logprobs import vocab_parallel_logprobs
from rlhf_mc.runtime.spawn import spawn

VOCAB, TOKENS = 50, 37


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(TOKENS, VOCAB, generator=g) * 3, torch.randint(0, VOCAB, (TOKENS,), generator=g)


def _reference(logits, targets, temperature):
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits / temperature, -1)
    picked = logp.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    (picked.sum() + 0.3 * entropy.sum()).backward()
    return picked.detach(), entropy.detach(), logits.grad


def _sharded(temperature):
    from rlhf_mc.config import ParallelConfig
    from rlhf_mc.runtime import init_parallel
    from megatron.core import parallel_state as ps

    init_parallel(ParallelConfig(tp=2))
    logits, targets = _inputs()
    rank = ps.get_tensor_model_parallel_rank()
    shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(shard, targets, ps.get_tensor_model_parallel_group(), temperature,
                                            with_entropy=True, chunk_tokens=8)
    (logp.sum() + 0.3 * entropy.sum()).backward()
    return logp.detach(), entropy.detach(), shard.grad


def test_single_process_matches_log_softmax():
    logits, targets = _inputs()
    for temperature in (1.0, 0.7):
        ref_logp, ref_entropy, ref_grad = _reference(logits, targets, temperature)
        x = logits.clone().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs(x, targets, None, temperature, with_entropy=True, chunk_tokens=5)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        assert (logp - ref_logp).abs().max() < 1e-5 and (entropy - ref_entropy).abs().max() < 1e-5
        assert (x.grad - ref_grad).abs().max() < 1e-5
    logp, entropy = vocab_parallel_logprobs(logits, targets)
    assert entropy is None and logp.shape == targets.shape
    # bf16 logits (a bf16 model's output) are upcast before the softmax: the same as on their fp32 values
    half = logits.bfloat16()
    ref_logp, ref_entropy, _ = _reference(half.float(), targets, 1.0)
    logp, entropy = vocab_parallel_logprobs(half, targets, None, with_entropy=True)
    assert logp.dtype == torch.float32 and (logp - ref_logp).abs().max() < 1e-5
    assert (entropy - ref_entropy).abs().max() < 1e-5


def test_tp2_matches_full_vocabulary():
    logits, targets = _inputs()
    ref_logp, ref_entropy, ref_grad = _reference(logits, targets, 0.7)
    results = spawn(_sharded, 2, 0.7)
    for rank, (logp, entropy, grad) in enumerate(results):
        assert (logp - ref_logp).abs().max() < 1e-5
        assert (entropy - ref_entropy).abs().max() < 1e-5
        assert (grad - ref_grad.chunk(2, dim=-1)[rank]).abs().max() < 1e-5
