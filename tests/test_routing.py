"""Rollout routing replay (models/routing.py) on a Qwen3-MoE actor at EP=2 (two ranks, two experts each).

The trainer's own routing is read from its routers (Megatron's RouterReplay, recording); then, against it:
- replaying it changes nothing (log-probs equal the unreplayed ones), replaying another routing changes the
  log-probs: the routers take the replayed experts;
- with replay on, an update still gives the routers gradients (their probabilities are gathered at the replayed
  experts);
- with replay off, the agreement the update reports is 1 for the trainer's own routing and, for another routing,
  the share of expert choices the two have in common, counted here by hand.
The engine's side (SGLang's routed experts, their alignment with the tokens) is checked by the MoE trainer test,
whose agreement with replay off is 1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig, PolicyLossConfig
from rlhf_mc.runtime.spawn import spawn

MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-qwen3-moe.yaml")
ONE_PACK = 8192  # micro-batch token budget that holds the whole batch


def _batch():
    from rlhf_mc.data.trajectory import Trajectories

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, MODEL.vocab_size, (n,), generator=g) for n in (13, 7, 18)]
    starts = [4, 3, 6]
    fields = {"advantages": [torch.randn(len(s) - st, generator=g) for s, st in zip(seqs, starts)],
              "rollout_logprobs": [torch.full((len(s) - st,), -5.0) for s, st in zip(seqs, starts)]}
    return Trajectories.single_turn(seqs, starts, fields)


def _own_routing(chunks, batch) -> torch.Tensor:
    """[T, layers * top-k]: the experts the model's routers choose for the batch's tokens (one micro-batch, packed
    longest first: put back in the batch's order)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from rlhf_mc.data.microbatch import micro_batches_by_tokens
    from rlhf_mc.workers.policy import compute_log_prob

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    compute_log_prob(chunks, batch, micro_batch_tokens=ONE_PACK)
    routers = sorted((m for m in chunks[0].modules() if getattr(m, "router_replay", None) is not None),
                     key=lambda r: r.layer_number)
    routing = torch.cat([r.router_replay.get_recorded_indices() for r in routers], dim=1).to(torch.int16)
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    lengths = batch.lengths.tolist()
    (packed,) = micro_batches_by_tokens(lengths, ONE_PACK)  # the pack compute_log_prob ran
    rows = dict(zip(packed, routing.split([lengths[i] for i in packed])))
    return torch.cat([rows[i] for i in range(len(lengths))])


def _worker() -> dict:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob
    from rlhf_mc.workers.train import train_step

    parallel = ParallelConfig(ep=2)
    init_parallel(parallel, seed=5)
    chunks = build_model(MODEL, parallel)
    batch = _batch()
    own = _own_routing(chunks, batch)
    other = own.clone()
    other[::2] = (other[::2] + 1) % MODEL.num_experts  # every other token's experts moved by one
    plain = compute_log_prob(chunks, batch)["logprobs"]
    replayed = {name: compute_log_prob(chunks, dataclasses.replace(batch, routed_experts=routing),
                                       replay_routing=True)["logprobs"]
                for name, routing in (("own", own), ("other", other))}
    state = setup_training(chunks, OptimizerConfig(lr=1e-3))
    agreement = {"own": train_step(state, dataclasses.replace(batch, routed_experts=own), PolicyLossConfig())}
    own_after_step = _own_routing(chunks, batch)  # the update may move near-ties
    agreement["other"] = train_step(state, dataclasses.replace(batch, routed_experts=other), PolicyLossConfig())
    agreement = {name: metrics["router/engine_agreement"] for name, metrics in agreement.items()}
    train_step(state, dataclasses.replace(batch, routed_experts=other), PolicyLossConfig(), replay_routing=True)
    router_grads = [float(p.main_grad.abs().sum()) for name, p in state.model[0].named_parameters()
                    if "router" in name]
    return {"own": own, "own_after_step": own_after_step, "other": other, "plain": plain, "replayed": replayed,
            "agreement": agreement, "router_grads": router_grads}


def test_routing_replay_and_agreement():
    results = spawn(_worker, 2)
    for r in results:
        own, other = r["own"], r["other"]
        assert own.shape == (38, MODEL.num_layers * MODEL.moe_topk) and not torch.equal(own, other)
        assert (r["replayed"]["own"] - r["plain"]).abs().max() < 1e-6
        assert (r["replayed"]["other"] - r["plain"]).abs().max() > 1e-3
        assert r["agreement"]["own"] == 1.0
        k = MODEL.moe_topk
        a, b = r["own_after_step"].view(len(own), -1, k).long(), other.view(len(other), -1, k).long()
        expected = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).double().mean().item()
        assert expected < 0.9 and abs(r["agreement"]["other"] - expected) < 1e-9
        assert len(r["router_grads"]) == MODEL.num_layers and all(g > 0 for g in r["router_grads"])
