"""compute_log_prob (packed, micro-batched by tokens, sharded) against the single-process padded computation:
Megatron at TP=1 on a right-padded batch with torch's full-vocabulary log_softmax, at every response token (the
results are aligned with the batch's tokens; the prompt's are 0: its logits are not computed). And the reference
swap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.runtime.spawn import spawn

MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-llama.yaml")
LENGTHS, STARTS = [12, 30, 7, 21, 16, 9], [4, 10, 3, 5, 8, 2]
TEMPERATURE, TOL = 0.8, 1e-5


def _batch():
    from rlhf_mc.data.trajectory import Trajectories

    g = torch.Generator().manual_seed(0)
    return Trajectories.single_turn([torch.randint(0, MODEL.vocab_size, (n,), generator=g) for n in LENGTHS], STARTS)


def _padded_reference(ckpt: str) -> list[dict]:
    """Independent path: no packing, no vocab-parallel op."""
    from rlhf_mc.models.checkpoint import save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    init_parallel(ParallelConfig(), seed=5)
    (model,) = build_model(MODEL, ParallelConfig())
    save_model([model], Path(ckpt) / "weights")
    seqs = _batch().rows()
    tokens = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    model.eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.size(1)).expand_as(tokens), None).float()
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    out = []
    for i, s in enumerate(seqs):
        rows = logp[i, :len(s) - 1]  # predicting tokens 1..
        out.append({"logprobs": rows.gather(-1, s[1:, None])[:, 0], "entropy": -(rows.exp() * rows).sum(-1)})
    return out


def _sharded(parallel: ParallelConfig, ckpt: str, micro_batch_tokens: int) -> list[dict]:
    from rlhf_mc.models.checkpoint import load_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob

    init_parallel(parallel)
    chunks = build_model(MODEL, parallel, init_weights=False)
    load_model(chunks, Path(ckpt) / "weights")
    batch = _batch()
    out = compute_log_prob(chunks, batch, TEMPERATURE, with_entropy=True, micro_batch_tokens=micro_batch_tokens)
    return [{k: batch.rows(v)[i] for k, v in out.items()} for i in range(len(batch))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("logprob_ref")
    (result,) = spawn(_padded_reference, 1, str(ckpt))
    return str(ckpt), result


# name: (layout, world size, micro_batch_tokens). With 40 the sequences spread over several packs; with
# 200 all six share one.
LAYOUTS = {
    "packed": (ParallelConfig(), 1, 40),
    "packed_one_micro_batch": (ParallelConfig(), 1, 200),
    "tp2": (ParallelConfig(tp=2), 2, 40),
    "pp2": (ParallelConfig(pp=2), 2, 40),
    "pp2_vpp2": (ParallelConfig(pp=2, vpp=2), 2, 40),
    "cp2": (ParallelConfig(cp=2), 2, 40),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_log_prob_matches_padded_single_process(name, reference):
    ckpt, expected = reference
    parallel, world, micro_batch_tokens = LAYOUTS[name]
    for rank_result in spawn(_sharded, world, parallel, ckpt, micro_batch_tokens):  # every rank gets the results
        for got, want, n, start in zip(rank_result, expected, LENGTHS, STARTS):
            for key in ("logprobs", "entropy"):
                # the response's tokens (the loss mask); the prompt's logits are not computed: 0
                assert got[key].shape == (n,) and (got[key][:start] == 0).all(), f"{name}: {key}"
                assert (got[key][start:] - want[key][start - 1:]).abs().max().item() < TOL, f"{name}: {key}"


def _bf16_packed_and_padded(ckpt: str) -> tuple[list[dict], list[dict]]:
    """A bf16 model (its logits leave the model in bf16, ops/logprobs.py upcasts them a chunk at a time): the
    packed micro-batches against the same model on the padded batch with Megatron's default fp32 output."""
    from rlhf_mc.models.checkpoint import load_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob

    init_parallel(ParallelConfig())
    chunks = build_model(MODEL, ParallelConfig(), dtype="bfloat16", init_weights=False)
    load_model(chunks, Path(ckpt) / "weights")
    batch = _batch()
    out = compute_log_prob(chunks, batch, TEMPERATURE, micro_batch_tokens=40)
    packed = [{"logprobs": lp} for lp in batch.rows(out["logprobs"])]
    seqs = batch.rows()
    tokens = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    with torch.no_grad():
        logits = chunks[0](tokens, torch.arange(tokens.size(1)).expand_as(tokens), None)
    assert logits.dtype == torch.float32  # Float16Module's default upcast, which the pipeline turns off
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    padded = [{"logprobs": logp[i, :len(s) - 1].gather(-1, s[1:, None])[:, 0]} for i, s in enumerate(seqs)]
    return packed, padded


def test_bf16_log_prob_matches_padded_bf16_model(reference):
    ckpt, _ = reference
    ((packed, padded),) = spawn(_bf16_packed_and_padded, 1, ckpt)
    for got, want, start in zip(packed, padded, STARTS):  # measured: <= 1.3e-3 where a pack holds several
        # sequences, else 5e-7
        assert (got["logprobs"][start:] - want["logprobs"][start - 1:]).abs().max().item() < 4e-3


def _swap(ckpt: str) -> dict:
    from rlhf_mc.models.checkpoint import load_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import HostReference, compute_log_prob

    parallel = ParallelConfig(tp=2)
    init_parallel(parallel)
    chunks = build_model(MODEL, parallel, init_weights=False)
    load_model(chunks, Path(ckpt) / "weights")
    reference = HostReference(chunks)
    with torch.no_grad():  # the actor moves away from the reference
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    actor_before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    batch = _batch()
    with reference.swapped_in(chunks):
        ref = batch.rows(compute_log_prob(chunks, batch, TEMPERATURE, micro_batch_tokens=40)["logprobs"])
    actor = batch.rows(compute_log_prob(chunks, batch, TEMPERATURE, micro_batch_tokens=40)["logprobs"])
    unchanged = all(torch.equal(p, actor_before[n]) for n, p in chunks[0].named_parameters())
    return {"ref": ref, "actor": actor, "unchanged": unchanged}


def test_reference_swap_is_exact_and_leaves_the_actor_bitwise_unchanged(reference):
    ckpt, expected = reference
    for r in spawn(_swap, 2, ckpt):
        assert r["unchanged"]
        for got, want, start in zip(r["ref"], expected, STARTS):
            assert (got[start:] - want["logprobs"][start - 1:]).abs().max().item() < TOL
        assert max((a[start:] - w["logprobs"][start - 1:]).abs().max().item()
                   for a, w, start in zip(r["actor"], expected, STARTS)) > 1e-3


def test_log_prob_pass_at_a_large_vocabulary_peaks_below_the_full_fp32_logits():
    """bench/logprob_memory.py's pass (Qwen3's 151936-token vocabulary, in a rank, so runtime/host.py's allocator
    settings apply), at 4096 tokens: the bf16 logits plus one chunk's fp32 buffers at a time (ops/logprobs.py),
    measured 1.35x the sequence's full fp32 logits (a chunk's buffers are a gigabyte each; 0.93x at 8192 tokens).
    Guards the allocator settings too: with no block mmap'ed, gigabyte blocks fragmented the heap and this pass peaked
    at 2.2x (runtime/host.py)."""
    from bench.logprob_memory import MODEL as LARGE_VOCAB, ours

    tokens = 4096
    ((grown, _),) = spawn(ours, 1, tokens)
    full_fp32_logits = tokens * LARGE_VOCAB.vocab_size * 4
    assert grown < 1.6 * full_fp32_logits, (grown / 2**30, full_fp32_logits / 2**30)
