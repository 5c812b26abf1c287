"""The actor's train step (policy loss + KL loss + entropy bonus, clipping, Adam) at TP=2, PP=2 x VPP=2, CP=2 and
DP=2 against the single-process step: the same loss metrics and grad norm, the same weights after the step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig, PolicyLossConfig
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.runtime.spawn import spawn

MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-llama.yaml")
LENGTHS, STARTS = [12, 30, 7, 21, 16, 9], [4, 10, 3, 5, 8, 2]
OPTIM = OptimizerConfig(lr=1e-3, eps=1e-3, weight_decay=0.0, clip_grad=1.0)  # eps: see test_parallel_parity.py
TOL = 1e-5


def _data():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, MODEL.vocab_size, (n,), generator=g) for n in LENGTHS]
    per_token = {k: [] for k in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")}
    for n, start in zip(LENGTHS, STARTS):
        per_token["advantages"].append(torch.randn(n - start, generator=g))
        per_token["old_logprobs"].append(-5.5 + 0.3 * torch.randn(n - start, generator=g))
        per_token["ref_logprobs"].append(-5.5 + 0.3 * torch.randn(n - start, generator=g))
        per_token["rollout_logprobs"].append(per_token["old_logprobs"][-1] + 0.1 * torch.randn(n - start, generator=g))
    return seqs, per_token


def _step(parallel: ParallelConfig, loss_cfg: PolicyLossConfig, ckpt: str, reference: bool) -> dict:
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.checkpoint import load_model, save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.train import train_step

    init_parallel(parallel, seed=11)
    chunks = build_model(MODEL, parallel)
    if reference:
        save_model(chunks, Path(ckpt) / "weights0")
    else:
        load_model(chunks, Path(ckpt) / "weights0")
    state = setup_training(chunks, OPTIM)
    seqs, per_token = _data()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = list(range(dp_rank, len(seqs), dp))
    batch = Trajectories.single_turn([seqs[i] for i in mine], [STARTS[i] for i in mine],
                                     {k: [v[i] for i in mine] for k, v in per_token.items()})
    metrics = train_step(state, batch, loss_cfg, temperature=0.9, micro_batch_tokens=40)
    diff = None
    if reference:
        save_model(chunks, Path(ckpt) / "weights1")
    else:
        expected = build_model(MODEL, parallel, init_weights=False)
        load_model(expected, Path(ckpt) / "weights1")
        diff = max((p.data - e.data).abs().max().item()
                   for c, ec in zip(chunks, expected) for p, e in zip(c.parameters(), ec.parameters()))
    return {"metrics": metrics, "param_diff": diff}


LOSS = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_loss_coef=0.1, entropy_coef=0.01)
LAYOUTS = {
    "tp2": (ParallelConfig(tp=2), 2),
    "pp2_vpp2": (ParallelConfig(pp=2, vpp=2), 2),
    "cp2": (ParallelConfig(cp=2), 2),
    "dp2": (ParallelConfig(), 2),
}


VARIANTS = {
    "token-mean": LOSS,
    "gspo": dataclasses.replace(LOSS, mode="gspo", aggregation="seq-mean-token-mean", dual_clip=None),
    # sequence-level quantities over packed rows, split over CP ranks: sequence TIS, geometric-mean rejection
    "corrected": dataclasses.replace(LOSS, tis_cap=1.2, tis_level="sequence", reject="geometric", reject_low=0.97,
                                     reject_high=1.03),
}


# GSPO and the sequence-level corrections differ from the PPO loss only in per-sequence sums: checked where sequences
# are split (CP, DP); the PPO loss at every layout
CASES = [*(("token-mean", name) for name in LAYOUTS), *((v, name) for v in VARIANTS if v != "token-mean"
                                                        for name in ("cp2", "dp2"))]


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """The single-process step for the loss variant the test is parametrized with (indirectly)."""
    loss = VARIANTS[request.param]
    ckpt = tmp_path_factory.mktemp("train_ref")
    (result,) = spawn(_step, 1, ParallelConfig(), loss, str(ckpt), True)
    return loss, str(ckpt), result["metrics"]


@pytest.mark.parametrize("reference, name", CASES, indirect=["reference"])
def test_train_step_matches_single_process(name, reference):
    loss, ckpt, expected = reference
    parallel, world = LAYOUTS[name]
    results = spawn(_step, world, parallel, loss, ckpt, False)
    assert 0 < expected["clip_fraction"] < 1 and expected["update_applied"]
    for r in results:
        assert r["param_diff"] < TOL, f"{name}: weights after the step differ by {r['param_diff']:.3g}"
        assert abs(r["metrics"]["grad_norm"] - expected["grad_norm"]) < TOL
        if "pg_loss" in r["metrics"]:  # last pipeline stage
            for key in ("pg_loss", "kl_loss", "entropy", "clip_fraction", "approx_kl", "dual_clip_fraction"):
                assert abs(r["metrics"][key] - expected[key]) < TOL, f"{name}: {key}"
            if loss.reject != "none":
                assert 0 < expected["rejected_fraction"] < 1
                for key in ("rejected_fraction", "is_weight", "rollout_ppl_ratio"):
                    assert abs(r["metrics"][key] - expected[key]) < TOL, f"{name}: {key}"


def _critic(parallel: ParallelConfig, ckpt: str, reference: bool) -> dict:
    from rlhf_mc.models.checkpoint import load_model, save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_values
    from rlhf_mc.workers.train import critic_train_step

    init_parallel(parallel, seed=13)
    chunks = build_model(MODEL, parallel, value_head=True)
    (save_model if reference else load_model)(chunks, Path(ckpt) / "critic0")
    seqs, per_token = _data()
    batch = Trajectories.single_turn(seqs, STARTS)
    values = batch.masked(compute_values(chunks, batch, micro_batch_tokens=40)["values"])
    out = {"values": values}
    if reference:  # independent: one right-padded forward, no packing
        tokens = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = s
        with torch.no_grad():
            padded = chunks[0](tokens, torch.arange(tokens.size(1)).expand_as(tokens), None)[..., 0]
        out["padded"] = [padded[i, start - 1:n - 1] for i, (start, n) in enumerate(zip(STARTS, LENGTHS))]
    noise = [(r + 5.5) / 3 for r in per_token["ref_logprobs"]]  # ~N(0, 0.1): old values off the current ones
    targets = {"old_values": [v + e for v, e in zip(values, noise)],
               "returns": [v + a for v, a in zip(values, per_token["advantages"])]}
    state = setup_training(chunks, OPTIM)
    out["metrics"] = critic_train_step(state, Trajectories.single_turn(seqs, STARTS, targets), clip=0.05,
                                       micro_batch_tokens=40)
    if reference:
        save_model(chunks, Path(ckpt) / "critic1")
    else:
        expected = build_model(MODEL, parallel, init_weights=False, value_head=True)
        load_model(expected, Path(ckpt) / "critic1")
        out["param_diff"] = max((p.data - e.data).abs().max().item()
                                for c, ec in zip(chunks, expected) for p, e in zip(c.parameters(), ec.parameters()))
    return out


def test_critic_values_and_step_match_single_process(tmp_path):
    (ref,) = spawn(_critic, 1, ParallelConfig(), str(tmp_path), True)
    for got, padded in zip(ref["values"], ref["padded"]):
        assert (got - padded).abs().max().item() < TOL
    assert 0 < ref["metrics"]["clip_fraction"] < 1
    for parallel, world in ((ParallelConfig(tp=2), 2), (ParallelConfig(pp=2), 2)):
        for r in spawn(_critic, world, parallel, str(tmp_path), False):
            for got, want in zip(r["values"], ref["values"]):
                assert (got - want).abs().max().item() < TOL
            assert r["param_diff"] < TOL
            if "value_loss" in r["metrics"]:
                assert abs(r["metrics"]["value_loss"] - ref["metrics"]["value_loss"]) < TOL


def _on_policy(parallel: ParallelConfig, ckpt: str, separate_forward: bool) -> dict:
    """One step without old log-probs (the update's own, detached), or with them from a forward pass first; the
    rollout log-probs are the forward's, shifted, so the reported difference has a known value."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.checkpoint import load_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob
    from rlhf_mc.workers.train import train_step

    init_parallel(parallel, seed=11)
    chunks = build_model(MODEL, parallel)
    load_model(chunks, Path(ckpt) / "weights0")
    seqs, per_token = _data()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = list(range(dp_rank, len(seqs), dp))
    seqs, starts = [seqs[i] for i in mine], [STARTS[i] for i in mine]
    batch = Trajectories.single_turn(seqs, starts)
    forward = {k: batch.masked(v) for k, v in compute_log_prob(chunks, batch, temperature=0.9, with_entropy=True,
                                                               micro_batch_tokens=40).items()}
    per_token = {"advantages": [per_token["advantages"][i] for i in mine],
                 "ref_logprobs": [per_token["ref_logprobs"][i] for i in mine],
                 "rollout_logprobs": [f + 0.25 for f in forward["logprobs"]]}
    if separate_forward:
        per_token["old_logprobs"] = forward["logprobs"]
    state = setup_training(chunks, OPTIM)
    metrics = train_step(state, Trajectories.single_turn(seqs, starts, per_token), LOSS, temperature=0.9,
                         micro_batch_tokens=40)
    old = torch.cat(forward["logprobs"])
    return {"metrics": metrics, "params": [p.data.clone() for c in chunks for p in c.parameters()],
            "entropy_sum": torch.cat(forward["entropy"]).sum().item(),
            "kl_sum": (old - torch.cat(per_token["ref_logprobs"])).sum().item(), "tokens": old.numel()}


@pytest.mark.parametrize("reference", ["token-mean"], indirect=True)  # the old log-probs enter every mode alike
def test_on_policy_step_without_old_logprobs_equals_the_step_after_their_forward(reference):
    """One optimizer step per batch: the update's own log-probs, detached, give the step that a separate
    old-log-prob pass gives (weights, losses, grad norm), and it reports that pass's figures (rollout difference,
    entropy, KL to the reference as token means over both data-parallel ranks)."""
    loss, ckpt, _ = reference
    (expected,) = spawn(_on_policy, 1, ParallelConfig(), ckpt, True)
    (alone,) = spawn(_on_policy, 1, ParallelConfig(), ckpt, False)
    for p, e in zip(alone["params"], expected["params"]):
        assert (p - e).abs().max().item() < TOL
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
        assert abs(alone["metrics"][key] - expected["metrics"][key]) < TOL, key
    assert abs(alone["metrics"]["rollout_logprob_diff"] - 0.25) < TOL
    assert abs(alone["metrics"]["token_entropy"] - expected["entropy_sum"] / expected["tokens"]) < TOL
    assert abs(alone["metrics"]["kl_ref"] - expected["kl_sum"] / expected["tokens"]) < TOL
    assert "rollout_logprob_diff" not in expected["metrics"]
    assert "approx_kl" in expected["metrics"] and "approx_kl" not in alone["metrics"]  # 0 by construction there
    for r in spawn(_on_policy, 2, ParallelConfig(), ckpt, False):
        if "pg_loss" in r["metrics"]:
            for key in ("pg_loss", "grad_norm", "rollout_logprob_diff", "token_entropy", "kl_ref"):
                assert abs(r["metrics"][key] - alone["metrics"][key]) < TOL, key


def _aligned() -> list[dict]:
    from types import SimpleNamespace

    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.train import _aligned_microbatches

    init_parallel(ParallelConfig())
    seqs = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    batch = Trajectories.single_turn([torch.tensor(s) for s in seqs], [2, 2, 1],
                                     {"advantages": [torch.tensor([1.0, 2.0]), torch.tensor([3.0]),
                                                     torch.tensor([4.0, 5.0, 6.0, 7.0])]})
    config = SimpleNamespace(context_parallel_size=1, tensor_model_parallel_size=1, sequence_parallel=False)
    mbs = _aligned_microbatches(batch, "seq-mean-token-mean", 8, config, interleaved=False)
    return [{k: mb[k][0].tolist() for k in ("tokens", "targets", "advantages", "weight", "segment")} for mb in mbs]


def test_microbatch_fields_sit_at_the_positions_that_predict_their_tokens():
    """Hand-computed: 8-token micro-batches of sequences [4, 3, 5 tokens] are {2, 1} (longest first) and {0};
    position t carries the values of token t + 1 of its sequence (0 at its last position and outside the loss mask);
    seq-mean-token-mean weighs a token 1 / (3 sequences x its sequence's trained tokens)."""
    (mbs,) = spawn(_aligned, 1)
    third, twelfth, sixth = (torch.tensor(x, dtype=torch.float32).item() for x in (1 / 3, 1 / 12, 1 / 6))
    assert mbs == [
        {"tokens": [12, 13, 14, 15, 16, 9, 10, 11], "targets": [13, 14, 15, 16, 0, 10, 11, 0],
         "advantages": [4, 5, 6, 7, 0, 0, 3, 0], "weight": [twelfth, twelfth, twelfth, twelfth, 0, 0, third, 0],
         "segment": [0, 0, 0, 0, 0, 1, 1, 1]},
        {"tokens": [5, 6, 7, 8], "targets": [6, 7, 8, 0], "advantages": [0, 1, 2, 0], "weight": [0, sixth, sixth, 0],
         "segment": [0, 0, 0, 0]},
    ]
