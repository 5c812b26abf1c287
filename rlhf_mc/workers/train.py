"""One optimizer step of the actor on a mini-batch: packed micro-batches through Megatron's pipeline schedule with
the clipped policy loss (plus KL loss and entropy bonus), gradient clipping, per-step metrics.

Every loss is a weighted sum of per-token terms over the whole mini-batch (all micro-batches, all data-parallel
ranks), with weights from the aggregation mode (token-mean: 1 / all tokens; token-sum: 1; seq-mean-token-sum:
1 / all sequences; seq-mean-token-mean: 1 / (all sequences x the sequence's tokens); seq-mean-token-sum-norm:
1 / (all sequences x norm_length)), so the step does not depend on how the
mini-batch is split over micro-batches or ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlhf_mc.algorithms import core
from rlhf_mc.config import PolicyLossConfig
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.models.routing import Routing
from rlhf_mc.optim import TrainState
from rlhf_mc.runtime import host_all_reduce


def _token_weights(lengths: list[int], aggregation: str, total_tokens: int, total_seqs: int, norm_length: int
                   ) -> list[float]:
    if aggregation == "token-mean":
        return [1.0 / max(total_tokens, 1)] * len(lengths)
    if aggregation == "token-sum":
        return [1.0] * len(lengths)
    if aggregation == "seq-mean-token-sum":
        return [1.0 / max(total_seqs, 1)] * len(lengths)
    if aggregation == "seq-mean-token-sum-norm":
        return [1.0 / (max(total_seqs, 1) * norm_length)] * len(lengths)
    return [1.0 / (max(total_seqs, 1) * max(n, 1)) for n in lengths]


def _aligned_microbatches(batch: Trajectories, aggregation: str, micro_batch_tokens: int, config, interleaved: bool,
                          norm_length: int = 1, with_routing: bool = False) -> list[dict]:
    """Packed micro-batches (this CP rank's part) carrying, besides the tokens, each per-token field of the batch
    plus the aggregation "weight" and the packed-sequence id "segment", aligned to the positions whose logits
    predict the tokens (position t carries the values of token t + 1), 0 outside the loss mask, and the
    "head_positions" inside it."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.runtime import device
    from rlhf_mc.workers.policy import align_to_predictions, build_microbatches, pad_multiple

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    lengths = batch.sampled_tokens().tolist()
    totals = host_all_reduce(torch.tensor([sum(lengths), len(lengths)], dtype=torch.float64),
                             ps.get_data_parallel_group())
    weights = _token_weights(lengths, aggregation, int(totals[0]), int(totals[1]), norm_length)
    # per token, the fields inside the loss mask, and the weight of each trained token (whole-batch tensor ops: the
    # loop over sequences they replace was ~5 of the 11 ms this function took a step at 256 sequences)
    flat = {k: v * batch.loss_mask for k, v in batch.fields.items()}
    flat["weight"] = batch.loss_mask.float() * torch.tensor(weights, dtype=torch.float32)[batch.sequence_ids()]
    interleaved_pp = ps.get_pipeline_model_parallel_world_size() if interleaved else 0
    routed = batch.rows(batch.routed_experts) if with_routing else None
    microbatches, groups = build_microbatches(batch.rows(), micro_batch_tokens, cp, cp_rank, interleaved_pp,
                                              device(), pad_multiple(config), routed)
    align_to_predictions(batch, flat, microbatches, groups)
    return microbatches


def _run(state: TrainState, microbatches: list[dict], loss_fn, routing: Routing | None = None) -> dict:
    """Forward/backward of every micro-batch and the optimizer step; metrics summed over DP x CP ranks. With
    `routing` off replay, the engine/trainer routing agreement is among them."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.pipeline import run_pipeline

    scale = len(microbatches) * ps.get_data_parallel_world_size()  # undoes the schedule's and DDP's averaging
    state.zero_grad()
    for chunk in state.model:
        chunk.train()
    reports = run_pipeline(state.model, microbatches, lambda mb, out: _scaled(loss_fn(mb, out), scale),
                           forward_only=False, routing=routing)
    step = state.step()
    # Each CP rank holds part of every sequence's tokens: metrics add up over data- and context-parallel ranks.
    metrics = _reduce_reports(reports, ps.get_data_parallel_group(with_context_parallel=True))
    if state.model[0].config.num_moe_experts:
        metrics.update(_router_losses(len(microbatches), state.model[0].config.num_layers))
    if routing is not None and not routing.replay:
        metrics["router/engine_agreement"] = routing.agreement(state.model[0].config.sequence_parallel)
    return {**metrics, **step}


def _router_losses(num_microbatches: int, num_layers: int) -> dict:
    """The router losses Megatron's routers recorded in this step's forward passes (per layer, summed over
    micro-batches, before their coefficient): means over micro-batches and layers, averaged over data-parallel
    ranks, as "router/<name>"; then cleared for the next step. Only the losses switched on are recorded."""
    from megatron.core import parallel_state as ps

    try:  # Megatron-Core >= 0.17
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker = get_moe_metrics_tracker()
        values, clear = {name: entry.values for name, entry in tracker.metrics.items()}, tracker.clear
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        values = {name: entry["values"] for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items()}
        clear = moe_utils.clear_aux_losses_tracker
    if not values:
        return {}
    names = sorted(values)
    # Each stage recorded its own layers; the TP ranks of a stage recorded the same values.
    totals = host_all_reduce(torch.stack([values[name].sum() for name in names]).double(),
                             ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group())
    totals /= num_microbatches * num_layers * ps.get_data_parallel_world_size()
    clear()
    return {f"router/{name}": value for name, value in zip(names, totals.tolist())}


def _scaled(loss_and_report, scale):
    loss, report = loss_and_report
    return loss * scale, report


# the ratio is 1 on an on-policy step: these read 0 by construction and are left out of its metrics
ON_POLICY_CONSTANTS = ("approx_kl", "clip_fraction", "dual_clip_fraction")


def train_step(state: TrainState, batch: Trajectories, cfg: PolicyLossConfig, temperature: float = 1.0,
               micro_batch_tokens: int = 8192, replay_routing: bool = False) -> dict:
    """Actor step on this rank's data-parallel share of a mini-batch, whose fields hold "advantages",
    "rollout_logprobs", "old_logprobs", and where used "ref_logprobs" (kl_loss_coef > 0).

    Without "old_logprobs" the step is on-policy (one optimizer step per batch): the old log-probs are this
    forward's own, detached, and the step reports what a separate old-log-prob pass would have given: the mean
    |old - rollout| log-prob difference, the mean token entropy and the k1 KL to the reference (and not the ratio's
    statistics, constant there: ON_POLICY_CONSTANTS).

    A mixture-of-experts batch with the engine's routing: replayed (`replay_routing`), or compared with the
    trainer's own ("router/engine_agreement"; under the rollout's weights in an on-policy step)."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.workers.policy import head_logprobs

    routing = Routing(replay=replay_routing) if batch.routed_experts is not None else None
    microbatches = _aligned_microbatches(batch, cfg.aggregation, micro_batch_tokens, config=state.model[0].config,
                                         interleaved=len(state.model) > 1, norm_length=cfg.norm_length,
                                         with_routing=routing is not None)
    tp_group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    on_policy = "old_logprobs" not in batch.fields

    def loss_fn(mb, logits):
        logprobs, entropy = head_logprobs(mb, logits, tp_group, temperature, cfg.entropy_coef > 0 or on_policy)
        logprobs, w = logprobs.unsqueeze(0), mb["weight"]
        mask = w > 0
        old = logprobs.detach() if on_policy else mb["old_logprobs"]
        ratio_weights, correction = None, {}
        if cfg.tis_cap is not None or cfg.reject != "none":
            # a packed row holds several sequences: their sums (a CP all-reduce) only where a level needs them
            by_sequence = (cfg.tis_cap is not None and cfg.tis_level == "sequence") or cfg.reject in ("sequence",
                                                                                                   "geometric")
            sums = _segment_sums(old - mb["rollout_logprobs"], mb["segment"], mask, cp_group) if by_sequence else None
            ratio_weights, correction = core.rollout_correction(
                old, mb["rollout_logprobs"], mask, cfg.tis_cap, cfg.tis_level, cfg.reject, cfg.reject_low,
                cfg.reject_high, seq_log_ratio=sums)
        seq_log_ratio = None
        if cfg.mode == "gspo":
            total, count = _segment_sums(logprobs.detach() - old, mb["segment"], mask, cp_group)
            seq_log_ratio = total / count.clamp(min=1)
        # The aggregation lives in the token weights; policy_loss then sums over the row ("seq-mean-token-sum" of
        # one row).
        pg, stats = core.policy_loss(
            logprobs, old, mb["advantages"], mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
            cfg.mode, aggregation="seq-mean-token-sum",
            token_weights=w if ratio_weights is None else w * ratio_weights, seq_log_ratio=seq_log_ratio)
        loss = pg
        report = {"pg_loss": pg.detach(), "tokens": mask.sum().detach().float(),
                  **{k: v * mask.sum() for k, v in {**stats, **correction}.items()
                     if not (on_policy and k in ON_POLICY_CONSTANTS)}}
        if on_policy:
            report["rollout_logprob_diff"] = ((old - mb["rollout_logprobs"]).abs() * mask).sum()
            report["token_entropy"] = (entropy.detach().unsqueeze(0) * mask).sum()
            if "ref_logprobs" in mb:
                report["kl_ref"] = (core.kl_penalty(old, mb["ref_logprobs"], "k1") * mask).sum()
        if cfg.kl_loss_coef > 0:
            kl_loss = (core.kl_penalty(logprobs, mb["ref_logprobs"], cfg.kl_estimator) * w).sum()
            loss = loss + cfg.kl_loss_coef * kl_loss
            report["kl_loss"] = kl_loss.detach()
        if cfg.entropy_coef > 0:
            entropy_mean = (entropy.unsqueeze(0) * w).sum()
            loss = loss - cfg.entropy_coef * entropy_mean
            report["entropy"] = entropy_mean.detach()
        return loss, report

    return _run(state, microbatches, loss_fn, routing)


def critic_train_step(state: TrainState, batch: Trajectories, clip: float = 0.2,
                      aggregation: core.Aggregation = "token-mean", micro_batch_tokens: int = 8192,
                      norm_length: int = 1) -> dict:
    """Critic step (a model built with value_head=True): clipped value loss against the batch's "returns", around
    its "old_values"."""
    microbatches = _aligned_microbatches(batch, aggregation, micro_batch_tokens, config=state.model[0].config,
                                         interleaved=len(state.model) > 1, norm_length=norm_length)

    def loss_fn(mb, output):
        w = mb["weight"]
        mask = w > 0
        loss, stats = core.value_loss(output[..., 0].float(), mb["old_values"], mb["returns"], mask, clip,
                                      aggregation="seq-mean-token-sum", token_weights=w)
        return loss, {"value_loss": loss.detach(), "tokens": mask.sum().detach().float(),
                      "clip_fraction": stats["value_clip_fraction"] * mask.sum()}

    return _run(state, microbatches, loss_fn)


def sft_step(state: TrainState, batch: Trajectories, micro_batch_tokens: int = 8192) -> dict:
    """Supervised step: token-mean negative log-likelihood of the loss-mask tokens over the whole mini-batch."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.workers.policy import head_logprobs

    microbatches = _aligned_microbatches(batch, "token-mean", micro_batch_tokens, config=state.model[0].config,
                                         interleaved=len(state.model) > 1)
    tp_group = ps.get_tensor_model_parallel_group()

    def loss_fn(mb, logits):
        logprobs, _ = head_logprobs(mb, logits, tp_group)
        w = mb["weight"][0]
        loss = -(logprobs * w).sum()
        return loss, {"sft_loss": loss.detach(), "tokens": (w > 0).sum().float()}

    return _run(state, microbatches, loss_fn)


def _segment_sums(values: torch.Tensor, segment: torch.Tensor, mask: torch.Tensor, cp_group
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the sum of `values` over the masked-in tokens of its packed sequence and their count (across CP
    ranks)."""
    seg = segment.long()
    count = int(seg.max().item()) + 1
    sums = torch.zeros(2, count, dtype=values.dtype, device=values.device)
    sums[0].index_add_(0, seg[mask], values[mask])
    sums[1].index_add_(0, seg[mask], torch.ones_like(values[mask]))
    if dist.get_world_size(cp_group) > 1:
        dist.all_reduce(sums, group=cp_group)
    return sums[0][seg], sums[1][seg]


def _reduce_reports(reports: list[dict], dp_group) -> dict:
    """Mini-batch metrics on every rank of the last stage: sums over micro-batches and data-parallel ranks."""
    if not reports:
        return {}
    keys = sorted(reports[0])
    totals = host_all_reduce(torch.stack([sum(r[k].float().cpu() for r in reports) for k in keys]).double(),
                             dp_group)
    out = dict(zip(keys, totals.tolist()))
    tokens = max(out.pop("tokens"), 1.0)
    for key in ("clip_fraction", "dual_clip_fraction", "approx_kl", "rollout_logprob_diff", "token_entropy", "kl_ref",
                "is_weight", "rejected_fraction", "log_ppl_ratio"):  # token averages
        if key in out:
            out[key] /= tokens
    if "log_ppl_ratio" in out:  # the rollout's perplexity over the trainer's
        out["rollout_ppl_ratio"] = math.exp(out.pop("log_ppl_ratio"))
    return out
