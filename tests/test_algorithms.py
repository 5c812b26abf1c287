"""Estimators and losses against hand-computed values, with masks and the edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_mc.algorithms import core as A

t = torch.tensor


def close(x, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert torch.allclose(torch.as_tensor(x, dtype=torch.float32), expected, atol=tol), x


LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


@pytest.mark.parametrize("mask, token_mean, token_sum, seq_sum, seq_mean, seq_sum_norm", [
    ([[1, 1, 0], [1, 0, 0]], 7 / 3, 7.0, 3.5, 2.75, (3 / 4 + 4 / 4) / 2),
    ([[1, 1, 0], [0, 0, 0]], 1.5, 3.0, 3.0, 1.5, 3 / 4),  # a sequence with no tokens is not counted
    ([[0, 0, 0], [0, 0, 0]], 0.0, 0.0, 0.0, 0.0, 0.0),  # all masked: zero, not NaN
])
def test_aggregation_modes(mask, token_mean, token_sum, seq_sum, seq_mean, seq_sum_norm):
    mask = t(mask)
    close(A.aggregate(LOSS, mask, "token-mean"), token_mean)
    close(A.aggregate(LOSS, mask, "token-sum"), token_sum)
    close(A.aggregate(LOSS, mask, "seq-mean-token-sum"), seq_sum)
    close(A.aggregate(LOSS, mask, "seq-mean-token-mean"), seq_mean)
    close(A.aggregate(LOSS, mask, "seq-mean-token-sum-norm", norm_length=4), seq_sum_norm)  # Dr. GRPO
    close(A.aggregate(LOSS, mask, "seq-mean-token-sum-norm"), seq_sum_norm * 4 / 3)  # default: the width, 3


def test_all_masked_loss_has_zero_finite_gradient():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, stats = A.policy_loss(logprobs, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert stats["clip_fraction"].item() == 0.0


def test_masked_whiten_ignores_masked_entries():
    x = t([[1.0, 3.0, 100.0]])
    out = A.masked_whiten(x, t([[1, 1, 0]]))
    close(out, [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]], tol=1e-4)  # mean 2, unbiased std sqrt(2)


def test_whitening_one_token_is_refused():
    """GAE (and REINFORCE++) whiten over the batch's tokens: with a single valid token the std is undefined. Refused
    with the count, as verl refuses it, where this returned a silent advantage of 0."""
    rewards, values = t([[0.0, 1.0], [2.0, 0.0]]), t([[0.5, 0.2], [0.1, 0.3]])
    with pytest.raises(ValueError, match="^masked_whiten: 1 masked-in entries; whitening needs at least 2"):
        A.gae_advantages(rewards, values, t([[0, 1], [0, 0]]))
    with pytest.raises(ValueError, match="masked_whiten: 0 masked-in entries"):
        A.reinforce_pp_advantages(rewards, t([[0, 0], [0, 0]]))
    adv, _ = A.gae_advantages(rewards, values, t([[0, 1], [1, 0]]))  # two tokens: +-1/sqrt(2)
    assert sorted(adv[t([[0, 1], [1, 0]]).bool()].tolist()) == pytest.approx([-2 ** -0.5, 2 ** -0.5], abs=1e-6)


def test_grpo():
    mask = torch.ones(4, 2)
    adv = A.grpo_advantages(t([1.0, 0.0, 1.0, 1.0]), t([0, 0, 1, 1]), mask)
    std = math.sqrt(0.5)  # unbiased std of [1, 0]
    close(adv[:, 0], [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0])  # all-equal group -> 0
    close(A.grpo_advantages(t([1.0, 0.0, 1.0, 1.0]), t([0, 0, 1, 1]), mask, norm_by_std=False)[:, 1],
          [0.5, -0.5, 0.0, 0.0])
    close(A.grpo_advantages(t([3.0]), t([7]), torch.ones(1, 2)), [[3 / (1 + 1e-6)] * 2])  # group of one
    close(A.grpo_advantages(t([1.0, 0.0]), t([0, 0]), t([[1, 1, 0], [1, 0, 0]]))[:, 2], [0.0, 0.0])  # masked


def test_rloo():
    close(A.rloo_advantages(t([1.0, 2.0, 3.0]), t([0, 0, 0]), torch.ones(3, 1))[:, 0], [-1.5, 0.0, 1.5])
    close(A.rloo_advantages(t([4.0]), t([0]), torch.ones(1, 1)), [[4.0]])


def test_discounted_returns_skip_masked_positions():
    close(A.discounted_returns(t([[0.0, 0.0, 1.0]]), t([[1, 1, 1]]), gamma=0.5), [[0.25, 0.5, 1.0]])
    close(A.discounted_returns(t([[0.0, 7.0, 1.0]]), t([[1, 0, 1]]), gamma=0.5), [[0.5, 0.0, 1.0]])


def test_reinforce_pp_variants():
    rewards, mask = t([[0.0, 1.0], [0.0, 3.0]]), torch.ones(2, 2)
    returns = t([[1.0, 1.0], [3.0, 3.0]])
    close(A.reinforce_pp_advantages(rewards, mask), A.masked_whiten(returns, mask))
    adv = A.reinforce_pp_baseline_advantages(t([1.0, 3.0]), t([0, 0]), mask)
    close(adv, A.masked_whiten(t([[-1.0, -1.0], [1.0, 1.0]]), mask))
    # groups of one keep their scores (3 and 5, not 0 and 0) before the batch whitening
    adv = A.reinforce_pp_baseline_advantages(t([1.0, 3.0, 3.0, 5.0]), t([0, 0, 1, 2]), torch.ones(4, 1))
    close(adv, A.masked_whiten(t([[-1.0], [1.0], [3.0], [5.0]]), torch.ones(4, 1)))


def test_gae():
    adv, ret = A.gae_advantages(t([[0.0, 1.0]]), t([[0.5, 0.2]]), t([[1, 1]]), gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.5, 0.8]])
    close(ret, [[1.0, 1.0]])
    adv, ret = A.gae_advantages(t([[0.0, 1.0]]), t([[0.5, 0.2]]), t([[1, 1]]), gamma=0.9, lam=0.5, whiten=False)
    close(adv, [[0.04, 0.8]])
    close(ret, [[0.54, 1.0]])
    adv, _ = A.gae_advantages(t([[0.0, 5.0, 1.0]]), t([[0.5, 9.0, 0.2]]), t([[1, 0, 1]]), whiten=False)
    close(adv, [[0.5, 0.0, 0.8]])  # the masked middle token neither adds its reward nor its value


def test_kl_estimators():
    logp, ref = t([-1.0]), t([-1.5])
    close(A.kl_penalty(logp, ref, "k1"), [0.5])
    close(A.kl_penalty(logp, ref, "k2"), [0.125])
    close(A.kl_penalty(logp, ref, "k3"), [math.exp(-0.5) + 0.5 - 1])
    close(A.kl_penalty(t([0.0]), t([-100.0]), "k3"), [10.0])  # log-ratio clamped to -20: 19, then clamped to 10
    close(A.kl_penalty(t([-2.0]), ref, "abs"), [0.5])
    with pytest.raises(ValueError, match="kl estimator: unknown 'k9'"):
        A.kl_penalty(logp, ref, "k9")
    with pytest.raises(ValueError, match="kl estimator: unknown 'k2\\+'"):
        A.kl_penalty(logp, ref, "k2+")


@pytest.mark.parametrize("estimator, value", [("k1+", 0.5), ("k3+", math.exp(-0.5) + 0.5 - 1), ("abs+", 0.5)])
def test_straight_through_kl_has_the_value_of_its_estimator_and_the_gradient_of_k2(estimator, value):
    logp = t([-1.0], requires_grad=True)
    kl = A.kl_penalty(logp, t([-1.5]), estimator)
    close(kl, [value])
    kl.sum().backward()
    close(logp.grad, [0.5])  # d/dlogp (logp - ref)^2 / 2 = logp - ref


def test_kl_in_reward_puts_the_score_on_the_last_token():
    rewards = A.token_rewards_with_kl(t([2.0]), t([[0.1, 0.2, 0.3]]), t([[1, 1, 0]]), beta=0.5)
    close(rewards, [[-0.05, -0.1 + 2.0, 0.0]])
    one_token = A.token_rewards_with_kl(t([1.0]), t([[0.4, 9.0]]), t([[1, 0]]), beta=1.0)
    close(one_token, [[-0.4 + 1.0, 0.0]])


def test_ppo_clip_and_clip_higher():
    logp, old = t([[math.log(1.5), math.log(0.5)]]), torch.zeros(1, 2)
    adv, mask = t([[1.0, -1.0]]), torch.ones(1, 2)
    loss, stats = A.policy_loss(logp, old, adv, mask, clip_low=0.2)
    close(loss, (-1.2 + 0.8) / 2)
    close(stats["clip_fraction"], 1.0)
    close(stats["approx_kl"], (-math.log(1.5) - math.log(0.5)) / 2)
    _, stats = A.policy_loss(t([[-60.0]]), torch.zeros(1, 1), t([[1.0]]), torch.ones(1, 1))
    close(stats["approx_kl"], 20.0)  # the log-ratio clamped at -20, as in the ratio
    loss, stats = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)  # DAPO clip-higher
    close(loss, (-1.5 + 0.8) / 2)
    close(stats["clip_fraction"], 0.5)


def test_dual_clip_caps_negative_advantages_only():
    logp, old = t([[math.log(5.0), math.log(5.0)]]), torch.zeros(1, 2)
    loss, stats = A.policy_loss(logp, old, t([[-1.0, 1.0]]), t([[1, 0]]), dual_clip=3.0)
    close(loss, 3.0)  # max(5, 1.2) = 5, capped at 3
    close(stats["dual_clip_fraction"], 1.0)
    loss, _ = A.policy_loss(logp, old, t([[-1.0, 1.0]]), t([[0, 1]]), dual_clip=3.0)
    close(loss, -1.2)  # positive advantage: ordinary clip
    with pytest.raises(ValueError, match="dual_clip: must be > 1"):
        A.policy_loss(logp, old, t([[1.0, 1.0]]), t([[1, 1]]), dual_clip=1.0)


def test_gspo_uses_the_sequence_ratio():
    logp = t([[math.log(2.0), 0.0]], requires_grad=True)
    loss, _ = A.policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), mode="gspo",
                            aggregation="seq-mean-token-mean")
    close(loss, -1.2)  # s = exp(mean(log 2, 0)) = sqrt(2) > 1.2: clipped
    loss, _ = A.policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), mode="gspo",
                            clip_low=0.5, aggregation="seq-mean-token-mean")
    close(loss, -math.sqrt(2))
    loss.backward()
    close(logp.grad, [[-math.sqrt(2) / 2, -math.sqrt(2) / 2]])  # d/dlogp_t of -sg[s] pi_t/sg[pi_t], mean over t


# trainer-minus-rollout log-ratios: sequence 0 has token ratios 3 and 0.5 (product 1.5, geometric mean 1.22),
# sequence 1 has 1.5 and 1.5 (product 2.25, geometric mean 1.5); the third column is masked out
OLD, MASK = torch.zeros(2, 3), t([[1, 1, 0], [1, 1, 0]])
ROLLOUT = -t([[math.log(3.0), math.log(0.5), 0.0], [math.log(1.5), math.log(1.5), 0.0]])


@pytest.mark.parametrize("kwargs, weights, rejected", [
    (dict(tis_cap=2.0), [[2.0, 0.5], [1.5, 1.5]], 0.0),  # token TIS
    (dict(tis_cap=2.0, tis_level="sequence"), [[1.5, 1.5], [2.0, 2.0]], 0.0),  # products 1.5 and 2.25 -> 2
    (dict(reject="token"), [[0.0, 1.0], [1.0, 1.0]], 0.25),  # IcePop: 3 is outside [0.5, 2]; 0.5 is inside
    (dict(reject="sequence"), [[1.0, 1.0], [0.0, 0.0]], 0.5),  # 2.25 outside
    (dict(reject="geometric", reject_high=1.4), [[1.0, 1.0], [0.0, 0.0]], 0.5),  # 1.5 outside, 1.22 inside
    (dict(tis_cap=2.0, reject="token"), [[0.0, 0.5], [1.5, 1.5]], 0.25),
])
def test_rollout_correction(kwargs, weights, rejected):
    w, stats = A.rollout_correction(OLD, ROLLOUT, MASK, **kwargs)
    close(w[:, :2], weights)
    close(stats["rejected_fraction"], rejected)
    close(stats["log_ppl_ratio"], math.log(3.0 * 0.5 * 1.5 * 1.5) / 4)
    if kwargs.get("tis_level", "token") == "token" and "tis_cap" in kwargs:
        close(stats["is_weight"], (2.0 + 0.5 + 1.5 + 1.5) / 4)


def test_token_weights_scale_the_policy_loss():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = A.policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), token_weights=t([[2.0, 0.5]]))
    close(loss, (-2.0 - 0.5) / 2)


def test_clipped_value_loss():
    loss, stats = A.value_loss(t([[1.0]]), t([[0.5]]), t([[2.0]]), t([[1]]), clip=0.2)
    close(loss, 0.5 * 1.69)
    close(stats["value_clip_fraction"], 1.0)
    loss, _ = A.value_loss(t([[1.0, 9.0]]), t([[1.0, 0.0]]), t([[2.0, 0.0]]), t([[1, 0]]), clip=0.2)
    close(loss, 0.5 * 1.0)


def test_overlong_penalty_grows_linearly_over_the_buffer():
    from rlhf_mc.rewards.shaping import overlong_penalty

    # budget 20, buffer 4: nothing up to 16 tokens, then -0.5 per token (penalty 2) to -2 at 20
    assert [overlong_penalty(n, 20, 4, 2.0) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert overlong_penalty(20, 20, 0, 2.0) == 0.0


def test_kl_in_reward_enters_the_outcome_estimators_scores():
    """GRPO with the KL in the reward (verl's): a sequence's score is its summed token rewards, score - coef * KL;
    two equal scores with different KLs then get opposite advantages (were 0 when the KL was dropped)."""
    from pathlib import Path

    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.trainer.loop import advantages
    from rlhf_mc.trainer.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml",
                         ["algorithm.estimator=grpo", "algorithm.kl_in_reward_coef=0.5",
                          "algorithm.kl_in_reward_estimator=k1"])
    old = [t([-1.0, -1.0]), t([-1.0])]
    per_token = {"rollout_logprobs": old, "old_logprobs": old, "ref_logprobs": [t([-1.5, -2.0]), t([-1.0])]}
    # prompts of 2 and 3 tokens: the KL on their tokens (old 0 vs ref 0 here) is outside the loss mask anyway
    batch = Trajectories.single_turn([[1, 2, 3, 4], [1, 2, 3, 4]], [2, 3], per_token, scores=[1.0, 1.0],
                                     groups=[0, 0])
    fields, current_kl = advantages(recipe, batch, kl_coef=0.5)
    adv = batch.rows(fields["advantages"])
    close(current_kl, (0.75 + 0.0) / 2)  # the mean over sequences of their token-mean KL
    # scores 1 - 0.5 * (0.5 + 1.0) = 0.25 and 1 - 0 = 1: mean 0.625, unbiased std 0.375 * sqrt(2)
    a = 0.375 / (0.375 * math.sqrt(2) + 1e-6)
    close(adv[0], [0, 0, -a, -a])
    close(adv[1], [0, 0, 0, a])


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_trainer_token_weights_give_the_aggregation(mode):
    """The trainer aggregates packed micro-batches through per-token weights (workers/train.py): the weighted sum
    over the mini-batch equals core.aggregate on the padded batch, every mode."""
    from rlhf_mc.workers.train import _token_weights

    mask = t([[1, 1, 0], [1, 1, 1]])
    lengths = [2, 3]
    weights = _token_weights(lengths, mode, total_tokens=5, total_seqs=2, norm_length=4)
    weighted = sum(w * LOSS[i, :n].sum() for i, (w, n) in enumerate(zip(weights, lengths)))
    close(weighted, A.aggregate(LOSS, mask, mode, norm_length=4))


def test_adaptive_kl_coef():
    # KL 3x the target: the error is clipped to 0.2; 100 sequences of a 1000-sequence horizon: x (1 + 0.02)
    close(A.adaptive_kl_coef(0.1, 0.3, 0.1, 1000, 100), 0.1 * 1.02)
    close(A.adaptive_kl_coef(0.1, 0.09, 0.1, 1000, 100), 0.1 * (1 - 0.1 * 0.1))
    close(A.adaptive_kl_coef(0.1, 0.0, 0.1, 16, 16), 0.08)  # no KL: the largest step down
