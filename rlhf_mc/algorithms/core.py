"""RL estimators and losses as pure functions on [batch, response_len] tensors with a response mask.

Conventions follow verl's where they are deliberate (users compare numbers), each stated where it applies. Where
verl's behaviour is an accident we do better: masked positions never enter a sum (scores, losses, whitening), and an
all-masked batch gives a zero loss, not NaN.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Aggregation = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
# "+": the straight-through variant (verl's): the estimator's value, k2's gradient (the unbiased one of the KL)
KLEstimator = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"]

LOG_RATIO_CLAMP = 20.0  # verl: log-ratios are clamped to +-20 before exp


# ----------------------------------------------------------------------------- masked statistics

def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum() if dim is None else \
        torch.where(mask.bool(), x, torch.zeros_like(x)).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over masked-in entries; 0 where there are none (never NaN)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked-in entries only (unbiased variance); masked positions become 0.

    Fewer than two masked-in entries raise ValueError, as verl does: the unbiased std of one value is 0/0, and
    centering it gives 0, a silent zero advantage (what this returned before). A run cannot reach it: the plan
    refuses a whitening estimator with fewer than two sequences a step, and every response has a token."""
    mask = mask.bool()
    count = mask.sum()
    if count < 2:
        raise ValueError(f"masked_whiten: {int(count)} masked-in entries; whitening needs at least 2 (the std of "
                         "one value is undefined)")
    mean = masked_mean(x, mask)
    var = masked_sum((x - mean) ** 2, mask) / (count - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros_like(out))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token-mean",
              norm_length: int | None = None) -> torch.Tensor:
    """Reduces a per-token loss [B, T] to a scalar.

    token-mean: over all masked-in tokens; token-sum: their sum; seq-mean-token-sum: mean over sequences of each
    sequence's token sum; seq-mean-token-mean: mean over sequences (with at least one token) of each sequence's token
    mean; seq-mean-token-sum-norm (Dr. GRPO): mean over sequences of each sequence's token sum / norm_length, a
    constant (the response budget; default T). verl divides the sum over a micro-batch by the constant and averages
    over micro-batches, which scales with the sequences per micro-batch; this mean over sequences does not.
    An all-masked batch gives 0."""
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "token-sum":
        return masked_sum(loss, mask)
    per_seq = masked_sum(loss, mask, dim=-1)
    has_tokens = mask.sum(-1) > 0
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / (norm_length or loss.size(-1))
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss aggregation: unknown mode {mode!r}")
    return masked_mean(per_seq, has_tokens)


# ----------------------------------------------------------------------------- advantages

def _broadcast(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scores.unsqueeze(-1) * mask.to(scores.dtype)


def grpo_advantages(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (score - group mean) / (group std + eps), broadcast over the response tokens.

    verl's conventions: the std is the unbiased one (torch.std) and eps is 1e-6; a group of one sample has mean 0
    and std 1, so it keeps its score. `norm_by_std=False` is Dr. GRPO (mean only).
    scores [B]; group [B] (group id per sample, e.g. its prompt index); mask [B, T]."""
    adv = torch.empty_like(scores)
    for g in torch.unique(group):
        members = group == g
        s = scores[members]
        if s.numel() == 1:
            mean, std = torch.zeros((), dtype=s.dtype), torch.ones((), dtype=s.dtype)
        else:
            mean, std = s.mean(), s.std()
        adv[members] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return _broadcast(adv, mask)


def rloo_advantages(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO: score minus the mean score of the other samples of its group; a group of one keeps its score."""
    adv = torch.empty_like(scores)
    for g in torch.unique(group):
        members = group == g
        s = scores[members]
        n = s.numel()
        adv[members] = s if n == 1 else s - (s.sum() - s) / (n - 1)
    return _broadcast(adv, mask)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Return-to-go over the masked-in tokens: masked positions neither add reward nor break the chain."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    mask = mask.to(token_rewards.dtype)
    for t in reversed(range(token_rewards.size(1))):
        running = mask[:, t] * (token_rewards[:, t] + gamma * running) + (1 - mask[:, t]) * running
        returns[:, t] = running * mask[:, t]
    return returns


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            ) -> torch.Tensor:
    """REINFORCE++: discounted return-to-go of the token rewards (score at the last token, minus the KL penalty per
    token when KL is in the reward), whitened over all masked-in tokens of the batch."""
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor,
                                     ) -> torch.Tensor:
    """REINFORCE++ with baseline: score minus its group mean, broadcast over the tokens, whitened over the batch. A
    group of one keeps its score (its baseline is 0, verl's convention, as GRPO and RLOO do here)."""
    centered = torch.empty_like(scores)
    for g in torch.unique(group):
        members = group == g
        s = scores[members]
        centered[members] = s if s.numel() == 1 else s - s.mean()
    return masked_whiten(_broadcast(centered, mask), mask)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 1.0, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE. Returns (advantages, returns = advantages + values). The value after the last token is 0. Masked
    positions are skipped: they carry the next value and the running estimate through unchanged (verl's newer
    convention), and get 0. Advantages are whitened over masked-in tokens when `whiten`."""
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.size(1))):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        updated = delta + gamma * lam * running
        running = mask[:, t] * updated + (1 - mask[:, t]) * running
        next_value = mask[:, t] * values[:, t] + (1 - mask[:, t]) * next_value
        advantages[:, t] = running * mask[:, t]
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def distillation_advantages(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                            coef: float = 1.0) -> torch.Tensor:
    """On-policy distillation's per-token advantage: coef * (log p_teacher - log p_student) of each sampled token,
    the negative of the reverse KL's per-token estimate (k1 of KL(student || teacher)); no baseline, no
    normalization (Thinking Machines' on-policy distillation, Tinker; slime's --opd-kl-coef adds it to any
    estimator's advantage the same way). 0 on masked-out tokens (prompt, tool results)."""
    return torch.where(mask.bool(), coef * (teacher_logprobs - logprobs), torch.zeros_like(logprobs))


# ----------------------------------------------------------------------------- KL

def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from the sampled tokens' log-probs.

    k1: log r with r = pi/ref; abs: |log r|; k2: (log r)^2 / 2; k3 (low_var_kl, verl's): ref/pi - log(ref/pi) - 1
    with log(ref/pi) clamped to +-20 and the result to [-10, 10]. A "+" suffix (k1+, k3+, abs+): the estimator's
    value with k2's gradient, straight through (k1's and k3's expected gradients are not the KL's; k2's is)."""
    log_ratio = logprobs - ref_logprobs
    base = estimator.removesuffix("+")
    if base == "k1":
        value = log_ratio
    elif base == "abs":
        value = log_ratio.abs()
    elif base == "k2" and estimator == "k2":
        return 0.5 * log_ratio ** 2
    elif base == "k3":
        kl = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        value = (torch.exp(kl) - kl - 1).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"kl estimator: unknown {estimator!r} (k1, k2, k3, abs, k1+, k3+, abs+)")
    if estimator.endswith("+"):
        k2 = 0.5 * log_ratio ** 2
        return k2 - k2.detach() + value.detach()
    return value


def adaptive_kl_coef(coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """The adaptive KL controller (Ziegler et al. 2019, verl's AdaptiveKLController): the coefficient times
    1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon, n_steps being the batch's sequences."""
    error = min(max(current_kl / target - 1, -0.2), 0.2)
    return coef * (1 + error * n_steps / horizon)


def token_rewards_with_kl(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """KL in the reward: -beta * kl on every response token, plus the score on the last masked-in token."""
    rewards = -beta * kl * mask.to(kl.dtype)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    return rewards + last.to(kl.dtype) * scores.unsqueeze(-1)


# ----------------------------------------------------------------------------- policy and value losses

def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float | None = None, dual_clip: float | None = None,
                mode: Literal["ppo", "gspo"] = "ppo", aggregation: Aggregation = "token-mean",
                token_weights: torch.Tensor | None = None, seq_log_ratio: torch.Tensor | None = None,
                norm_length: int | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped policy-gradient loss and its statistics.

    ppo: token ratio exp(clamp(logp - old, +-20)); loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).
      clip_high (DAPO's clip-higher) defaults to clip_low.
    dual_clip c (> 1): where A < 0 the loss is capped at -A c (verl: only for negative advantages).
    gspo: the sequence-level ratio exp(mean over the sequence's tokens of (logp - old)), its log clamped above at
      10, applied per token as sg[s_i] * pi/sg[pi] (GSPO-token); use with aggregation "seq-mean-token-mean".
    token_weights: per-token weights (truncated importance sampling), applied to the per-token loss.
    seq_log_ratio: for gspo on packed rows, each token's sequence mean log-ratio, computed by the caller (a row
      then holds several sequences); by default each row is one sequence.
    Stats: clip_fraction (tokens where the clipped branch is taken), dual_clip_fraction (tokens capped by the dual
    clip, the lower bound on negative advantages), approx_kl (mean of old - logp, the log-ratio
    clamped as the ratio's)."""
    clip_high = clip_low if clip_high is None else clip_high
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip: must be > 1, got {dual_clip}")
    raw_log_ratio = logprobs - old_logprobs
    log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if mode == "ppo":
        ratio = torch.exp(log_ratio)
    elif mode == "gspo":
        if seq_log_ratio is None:
            seq_log_ratio = masked_mean(raw_log_ratio, mask, dim=-1).unsqueeze(-1)
        token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()
        ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    else:
        raise ValueError(f"policy loss mode: unknown {mode!r}")
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        dual_clipped = (advantages < 0) & (-advantages * dual_clip < loss)
        loss = torch.where(dual_clipped, -advantages * dual_clip, loss)
    if token_weights is not None:
        loss = loss * token_weights.detach()
    stats = {"clip_fraction": masked_mean((clipped > unclipped).float(), mask).detach(),
             "dual_clip_fraction": masked_mean(dual_clipped.float(), mask).detach(),
             "approx_kl": masked_mean(-log_ratio, mask).detach()}
    return aggregate(loss, mask, aggregation, norm_length), stats


RejectLevel = Literal["none", "token", "sequence", "geometric"]


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       tis_cap: float | None = None, tis_level: Literal["token", "sequence"] = "token",
                       reject: RejectLevel = "none", reject_low: float = 0.5, reject_high: float = 2.0,
                       seq_log_ratio: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, dict]:
    """Per-token loss weights for the gap between the trainer's old log-probs and the rollout engine's (other
    kernels, precisions, or an older policy), from the ratio r = pi_old / pi_rollout. Detached.

    tis_cap (truncated importance sampling): weight min(r, cap), r per token (tis_level "token") or the sequence's
    product of the token ratios ("sequence"). reject (masked importance sampling; its token level is IcePop):
    weight 0 where the ratio lies outside [reject_low, reject_high] - the token's ratio ("token"), its sequence's
    product ("sequence"), or its sequence's geometric mean ("geometric"). The rejected tokens stay in the
    aggregation's denominators (they count as zero-loss tokens): the step's scale does not move with the rejected
    fraction. seq_log_ratio: per token, its sequence's (sum of log r, token count), from the caller when a row holds
    several sequences; by default each row is one sequence.
    Stats (token means): is_weight (before rejection), rejected_fraction, log_ppl_ratio (mean log r: the log of the
    rollout's perplexity over the trainer's)."""
    mask = mask.bool()
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    if seq_log_ratio is None:
        seq_sum, seq_count = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1), mask.sum(-1, keepdim=True)
    else:
        seq_sum, seq_count = seq_log_ratio
    weights = torch.ones_like(log_ratio)
    if tis_cap is not None:
        level = log_ratio if tis_level == "token" else seq_sum.expand_as(log_ratio)
        weights = torch.exp(level.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=tis_cap)
    keep = torch.ones_like(mask)
    if reject != "none":
        level = {"token": log_ratio, "sequence": seq_sum,
                 "geometric": seq_sum / seq_count.clamp(min=1)}[reject].expand_as(log_ratio)
        keep = (level >= math.log(reject_low)) & (level <= math.log(reject_high))
    stats = {"is_weight": masked_mean(weights, mask), "rejected_fraction": masked_mean((~keep).float(), mask),
             "log_ppl_ratio": masked_mean(log_ratio, mask)}
    return weights * keep, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2, aggregation: Aggregation = "token-mean",
               token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss, verl's convention: 0.5 x the aggregated max of the clipped and unclipped squared error.
    token_weights multiply the per-token error before aggregation."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    error = torch.maximum(unclipped_error, clipped_error)
    if token_weights is not None:
        error = error * token_weights.detach()
    loss = 0.5 * aggregate(error, mask, aggregation)
    return loss, {"value_clip_fraction": masked_mean((clipped_error > unclipped_error).float(), mask).detach()}
