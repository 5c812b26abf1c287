"""The rollout manager: generate -> score -> filter -> trajectories, and validation, for the loop (DESIGN.md, "One
training step"). The rollout function and the group filter come from the recipe by import path
(rollout/functions.py has the defaults and the signatures)."""

from __future__ import annotations

import functools

from rlhf_mc.config import import_by_path
from rlhf_mc.data.dataset import Prompt
from rlhf_mc.data.trajectory import Sample, Trajectories
from rlhf_mc.rewards.scoring import RewardScorer
from rlhf_mc.rewards.shaping import overlong_penalty
from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.sync.weights import check_versions
from rlhf_mc.tools.executor import ToolExecutor
from rlhf_mc.trainer.metrics import Timer
from rlhf_mc.trainer.recipe import Recipe


class RolloutManager:
    def __init__(self, recipe: Recipe, cluster, schedule, tokenizer, scorer: RewardScorer | None, reward_model):
        self.recipe, self.tokenizer, self.scorer, self.reward_model = recipe, tokenizer, scorer, reward_model
        self.generate = functools.partial(cluster.generate, restore=schedule.restore_engine)
        r = recipe.rollout
        # a multi-turn function gets the recipe's tools (trainer/plan.check_launch: only one that takes them)
        self.tools = ToolExecutor(recipe.tools) if recipe.tools.functions else None
        self.function = functools.partial(import_by_path("rollout.function", r.function), **r.function_kwargs,
                                          **({"tools": self.tools} if self.tools else {}))
        self.keep_group = import_by_path("algorithm.group_filter", recipe.algorithm.group_filter)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    def rollout(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Sample]:
        return self.function(self.generate, prompts, sampling, self.tokenizer)

    def sample(self, prompts: list[Prompt], sampling: SamplingParams, version: int, more_prompts, timer: Timer
               ) -> tuple[Trajectories, dict]:
        """The step's scored trajectories and their stats. Samples without a sampled token (prompts over the
        context) are left out. With algorithm.dynamic_sampling_max_rounds (DAPO), the groups the group filter
        refuses are dropped and rounds of rollout go on, on `more_prompts(round)`, until data.train_batch_size
        prompts have groups kept (the last round's surplus is left unused); running out of rounds is an error."""
        max_rounds, want = self.recipe.algorithm.dynamic_sampling_max_rounds, self.recipe.data.train_batch_size
        kept: list[Sample] = []
        kept_scores: list[float] = []
        kept_prompts = 0
        stats: dict[str, float] = {"data/samples_empty": 0, "data/groups_dropped": 0}
        for round_ in range(max(max_rounds, 1)):
            with timer("rollout"):
                samples = self.rollout(prompts, sampling)
            check_versions([v for s in samples for v, m in zip(s.versions, s.loss_mask) if m], version)
            answered = [s for s in samples if any(s.loss_mask)]
            stats["data/samples_empty"] += len(prompts) * sampling.n - len(answered)
            stats.update(trajectory_stats(answered))
            with timer("reward"):
                scores, reward_stats = self.score(prompts, answered)
            for k, v in reward_stats.items():  # counts add up over rounds; means are the last round's
                stats[k] = stats.get(k, 0) + v if k in ("reward/failures", "reward/timeouts") else v
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(answered):
                groups.setdefault(s.prompt_index, []).append(i)
            for members in groups.values():
                if max_rounds and not self.keep_group([scores[i] for i in members]):
                    stats["data/groups_dropped"] += 1
                    continue
                if max_rounds and kept_prompts == want:
                    continue
                for i in members:  # the group ids of the step's batch: its prompts in order
                    answered[i].prompt_index = kept_prompts
                kept += [answered[i] for i in members]
                kept_scores += [scores[i] for i in members]
                kept_prompts += 1
            if not max_rounds or kept_prompts == want:
                stats["data/rollout_rounds"] = round_ + 1
                return Trajectories.from_samples(kept, kept_scores), stats
            prompts = more_prompts(round_ + 1)
        raise RuntimeError(f"algorithm.dynamic_sampling_max_rounds: after {max_rounds} rounds only {kept_prompts} "
                           f"of data.train_batch_size={want} prompts had groups the group filter kept "
                           f"({stats['data/groups_dropped']} groups dropped)")

    def score(self, prompts: list[Prompt], samples: list[Sample]) -> tuple[list[float], dict]:
        """Per sample: the rule's score (reward.function) plus the reward model's (reward.model) plus the overlong
        penalty on the sampled tokens, with their stats."""
        scores, stats = [0.0] * len(samples), {}
        if self.scorer is not None:
            scores, stats = self.scorer.score([s.text for s in samples],
                                              [prompts[s.prompt_index].answer for s in samples],
                                              [prompts[s.prompt_index].text for s in samples],
                                              [s.messages for s in samples])
        if self.reward_model is not None:
            learned = self.reward_model.score([s.tokens for s in samples])
            scores = [a + b for a, b in zip(scores, learned)]
            stats["reward/model_mean"] = sum(learned) / len(learned)
        reward, max_length = self.recipe.reward, self.recipe.data.max_response_length
        if reward.overlong_buffer:
            penalties = [overlong_penalty(sum(s.loss_mask), max_length, reward.overlong_buffer,
                                          reward.overlong_penalty) for s in samples]
            scores = [a + b for a, b in zip(scores, penalties)]
            stats["reward/overlong_penalty_mean"] = sum(penalties) / len(penalties)
        return scores, stats

    def validate(self, prompts: list[Prompt]) -> dict:
        """Greedy accuracy (score >= reward.correct_score) and, with rollout.val_n > 1, pass@val_n over samples."""
        r, max_new = self.recipe.rollout, self.recipe.data.max_response_length
        eos = (self.tokenizer.eos_token_id,)
        samples = self.rollout(prompts, SamplingParams(temperature=0, max_new_tokens=max_new, stop_token_ids=eos))
        scores, _ = self.score(prompts, samples)
        correct = self.recipe.reward.correct_score
        out = {"val/accuracy": sum(s >= correct for s in scores) / len(scores),
               "val/reward": sum(scores) / len(scores),
               **{k.replace("rollout/", "val/"): v for k, v in trajectory_stats(samples).items()}}
        if r.val_n > 1:
            sampling = SamplingParams(n=r.val_n, temperature=r.val_temperature, top_p=r.top_p, top_k=r.top_k,
                                      max_new_tokens=max_new, stop_token_ids=eos)
            samples = self.rollout(prompts, sampling)
            scores, _ = self.score(prompts, samples)
            solved = {s.prompt_index for s, score in zip(samples, scores) if score >= correct}
            out[f"val/pass@{r.val_n}"] = len(solved) / len(prompts)
        return out


def trajectory_stats(samples: list[Sample]) -> dict[str, float]:
    """The means over samples of what the rollout function counted per trajectory (multi-turn: turns, tool calls,
    tool errors, ...), as rollout/<name>."""
    names = sorted({k for s in samples for k in s.stats})
    return {f"rollout/{k}": sum(s.stats.get(k, 0) for s in samples) / len(samples) for k in names}
