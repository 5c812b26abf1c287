"""Sharded Megatron models (gloo, fp32) against the single-process model: logits, gradients and one optimizer step.

The single-process reference saves its initial weights, its gradients and its weights after one Adam step as
Megatron distributed checkpoints; each sharded run loads the initial weights at its own layout (Megatron's
resharding), runs the same micro-batches, and compares its own shards with the reference checkpoints loaded at its
layout. Logits are gathered (TP over the vocabulary, CP over the sequence) and compared in the test process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig
from rlhf_mc.runtime.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
MODELS = {name: ModelConfig.from_yaml(ROOT / "model_configs" / f"{name}.yaml")
          for name in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3")}
MODEL = MODELS["tiny-llama"]
# Adam's first update is lr * g / (|g| + eps): with the usual tiny eps it is lr * sign(g), and rounding-level
# gradient differences flip near-zero entries by up to lr. eps = lr keeps the update's sensitivity to g at most 1.
OPTIM = OptimizerConfig(lr=1e-3, eps=1e-3, weight_decay=0.0, clip_grad=1.0)
TOL = 1e-5
SEQ = 32
LENGTHS = [[32, 19], [27, 8]]  # two micro-batches of two sequences (real lengths; padded to SEQ)


def _batch() -> torch.Tensor:
    """Tokens [micro-batches, samples, SEQ + 1]: inputs are [:, :, :-1], labels [:, :, 1:]."""
    return torch.randint(1, MODEL.vocab_size, (len(LENGTHS), len(LENGTHS[0]), SEQ + 1),
                         generator=torch.Generator().manual_seed(0))


def _microbatches(tokens: torch.Tensor, packed: bool) -> tuple[list[dict], list[tuple[int, int]]]:
    """This rank's micro-batches (its DP share of the samples, its CP part of each sequence) and the global
    (micro-batch, sample) ids of the samples in them."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.data.packing import pack
    from rlhf_mc.runtime.context_parallel import split_for_cp

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    total_tokens = sum(map(sum, LENGTHS))
    mbs, ids = [], []
    for m, (mb_tokens, lengths) in enumerate(zip(tokens, LENGTHS)):
        share = len(lengths) // dp
        samples = range(dp_rank * share, (dp_rank + 1) * share)
        ids += [(m, i) for i in samples]
        inputs, labels = mb_tokens[:, :-1], mb_tokens[:, 1:]
        if packed:
            seqs = [pack([t[i, :lengths[i]] for i in samples], multiple=2 * cp) for t in (inputs, labels)]
            mask = pack([torch.ones(lengths[i]) for i in samples], multiple=2 * cp).tokens.float()
            (p_in, p_lab), cu = seqs, seqs[0].cu_seqlens
            mb = dict(tokens=p_in.tokens, position_ids=p_in.position_ids, labels=p_lab.tokens, mask=mask,
                      packed_seq_params=p_in.packed_seq_params(), packed=p_in)
        else:
            pos = torch.arange(SEQ)
            mask = (pos < torch.tensor([lengths[i] for i in samples]).unsqueeze(1)).float()
            keep = list(samples)
            mb = dict(tokens=inputs[keep] * mask.long(), position_ids=pos.expand(len(keep), SEQ).contiguous(),
                      labels=labels[keep], mask=mask)
            cu = None
        for key in ("tokens", "position_ids", "labels", "mask"):
            mb[key] = split_for_cp(mb[key], cp, cp_rank, dim=1, cu_seqlens=cu)
        # Sum over this rank's tokens; schedule (x cp / micro-batches) and DDP (/ dp*cp) make the global mean.
        mb["loss_scale"] = dp / total_tokens
        mbs.append(mb)
    return mbs, ids


def _worker(parallel: ParallelConfig, packed: bool, distributed_optimizer: bool, ckpt: str, reference: bool,
            model_name: str = "tiny-llama") -> dict:
    """Runs forward (logits), forward+backward and one optimizer step. The reference saves checkpoints of its
    weights, gradients and stepped weights; the others compare with them and report max abs differences."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.checkpoint import load_model, save_model
    from rlhf_mc.runtime.context_parallel import gather_from_cp
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.models.pipeline import run_pipeline
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel

    ckpt, model = Path(ckpt), MODELS[model_name]
    init_parallel(parallel, seed=1)
    chunks = build_model(model, parallel)
    if reference:
        save_model(chunks, ckpt / "weights0")
    else:
        load_model(chunks, ckpt / "weights0")
    state = setup_training(chunks, dataclasses.replace(OPTIM, use_distributed_optimizer=distributed_optimizer))
    mbs, ids = _microbatches(_batch(), packed)

    def gather_logits(mb, logits):
        logits = torch.cat(_all_gather(logits, ps.get_tensor_model_parallel_group()), dim=-1)
        cu = mb["packed"].cu_seqlens if packed else None
        logits = gather_from_cp(logits, ps.get_context_parallel_group(), dim=1, cu_seqlens=cu)
        per_sample = mb["packed"].unpack(logits[0]) if packed else list(logits)
        return torch.zeros(()), {"logits": per_sample}

    reports = run_pipeline(state.model, [{k: v for k, v in mb.items() if k != "labels"} for mb in mbs],
                           gather_logits, forward_only=True)
    logits = {}
    per_mb = len(ids) // len(mbs)
    for m, report in enumerate(reports):
        for j, out in enumerate(report["logits"]):
            logits[ids[m * per_mb + j]] = out

    def masked_loss(mb, token_loss):
        loss = (token_loss * mb["mask"]).sum() * mb["loss_scale"]
        return loss, {"loss": loss.detach().clone()}

    state.zero_grad()
    run_pipeline(state.model, mbs, masked_loss, forward_only=False)
    result = {"logits": logits, "last_stage": ps.is_pipeline_last_stage(),
              "tp_rank": ps.get_tensor_model_parallel_rank(), "cp_rank": ps.get_context_parallel_rank(),
              "grad_diff": {}, "param_diff": {}}
    grads = build_model(model, parallel)
    if reference:
        for chunk, grad_chunk in zip(chunks, grads):
            for p, g in zip(chunk.parameters(), grad_chunk.parameters()):
                g.data.copy_(p.main_grad)
        save_model(grads, ckpt / "grads")
    elif not distributed_optimizer:  # which keeps only its shard of the gradients on each DP x CP rank
        load_model(grads, ckpt / "grads")
        result["grad_diff"] = _max_diffs(chunks, grads, lambda p: p.main_grad)
    result["step"] = state.step()
    if reference:
        save_model(chunks, ckpt / "weights1")
    else:
        stepped = build_model(model, parallel)
        load_model(stepped, ckpt / "weights1")
        result["param_diff"] = _max_diffs(chunks, stepped, lambda p: p.data)
    return result


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return parts


def _max_diffs(chunks, expected_chunks, value) -> dict[str, float]:
    diffs = {}
    for i, (chunk, expected) in enumerate(zip(chunks, expected_chunks)):
        for (name, p), (_, e) in zip(chunk.named_parameters(), expected.named_parameters()):
            diffs[f"chunk{i}.{name}"] = (value(p).float() - e.data.float()).abs().max().item()
    return diffs


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    ckpt = tmp_path_factory.mktemp("reference")
    (result,) = spawn(_worker, 1, ParallelConfig(), False, False, str(ckpt), True)
    return ckpt, result


# name: (layout, world size, packed input, distributed optimizer). Gradients are compared where the optimizer is
# not distributed (a distributed optimizer leaves each rank only its shard of them); the stepped weights everywhere.
LAYOUTS = {
    "tp2": (ParallelConfig(tp=2), 2, False, False),
    "pp2": (ParallelConfig(pp=2), 2, False, False),
    "tp2_pp2": (ParallelConfig(tp=2, pp=2), 4, False, False),
    "pp2_vpp2": (ParallelConfig(pp=2, vpp=2), 2, False, False),
    "pp2_vpp2_cp2": (ParallelConfig(pp=2, vpp=2, cp=2), 4, False, False),
    "cp2": (ParallelConfig(cp=2), 2, False, False),
    "tp2_cp2": (ParallelConfig(tp=2, cp=2), 4, False, False),
    "packed": (ParallelConfig(), 1, True, False),
    "packed_tp2_cp2": (ParallelConfig(tp=2, cp=2), 4, True, False),
    "dp2_distributed_optimizer": (ParallelConfig(), 2, False, True),
    "tp2_dp2_distributed_optimizer": (ParallelConfig(tp=2), 4, False, True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_single_process(name, reference):
    ckpt, ref = reference
    parallel, world, packed, distributed_optimizer = LAYOUTS[name]
    results = spawn(_worker, world, parallel, packed, distributed_optimizer, str(ckpt), False)
    _check(name, results, ref, distributed_optimizer)


def test_tied_embeddings_across_pipeline_stages(tmp_path):
    """Tied input/output embeddings live on the first and the last stage: their gradients must be summed across
    stages (Megatron's embedding group) for the step to match. tiny-qwen3 also has q/k norms."""
    (ref,) = spawn(_worker, 1, ParallelConfig(), False, False, str(tmp_path), True, "tiny-qwen3")
    results = spawn(_worker, 4, ParallelConfig(tp=2, pp=2), False, False, str(tmp_path), False, "tiny-qwen3")
    _check("tied_tp2_pp2", results, ref, distributed_optimizer=False)


@pytest.mark.parametrize("model_name", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_expert_parallel_matches_single_process(tmp_path, model_name):
    """A MoE model at EP=2 (two data-parallel ranks, each holding half the experts; the all-to-all dispatcher sends
    tokens to the rank of their experts) against one process holding all: logits, gradients (expert gradients are
    reduced over the expert-data-parallel group, here of size 1) and one Adam step. Router losses off: the
    load-balancing loss of a data-parallel share is not that of the whole batch. The EP ranks take packed
    micro-batches, the reference padded ones. tiny-deepseek-v3: sigmoid router with an expert bias, grouped
    top-k, a shared expert, a dense first layer (GLM-4.5's MoE) and multi-latent attention with YaRN."""
    (ref,) = spawn(_worker, 1, ParallelConfig(), False, False, str(tmp_path), True, model_name)
    results = spawn(_worker, 2, ParallelConfig(ep=2), True, False, str(tmp_path), False, model_name)
    _check("ep2", results, ref, distributed_optimizer=False)


def _check(name: str, results: list[dict], ref: dict, distributed_optimizer: bool) -> None:
    logits = {}
    for r in results:
        if r["last_stage"] and r["tp_rank"] == 0 and r["cp_rank"] == 0:
            logits.update(r["logits"])
    assert sorted(logits) == sorted(ref["logits"])
    for (m, i), out in logits.items():
        length = LENGTHS[m][i]
        diff = (out[:length] - ref["logits"][(m, i)][:length]).abs().max().item()
        assert diff < TOL, f"{name}: logits of sample {(m, i)} differ by {diff:.3g}"

    for r in results:
        assert r["param_diff"] and (distributed_optimizer or r["grad_diff"]), "nothing compared"
        for key in ("grad_diff", "param_diff"):
            worst = max(r[key].items(), key=lambda kv: kv[1], default=("-", 0.0))
            assert worst[1] < TOL, f"{name}: {key} {worst[0]} = {worst[1]:.3g}"
        assert r["step"]["update_applied"]
        assert abs(r["step"]["grad_norm"] - ref["step"]["grad_norm"]) < TOL * max(1.0, ref["step"]["grad_norm"])
