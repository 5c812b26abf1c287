"""The rollout manager (trainer/rollouts.py) with a rollout function and a group filter named by import path: what
it keeps, drops, refills and refuses. The rollout function here is the user's code the recipe names; it does not
call the engines (the trainer tests run the default one against SGLang)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from rlhf_mc.config import ConfigError
from rlhf_mc.data.dataset import Prompt
from rlhf_mc.data.trajectory import NOT_SAMPLED, Sample
from rlhf_mc.rewards.scoring import RewardScorer
from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.sync.weights import StaleWeights
from rlhf_mc.trainer.metrics import Timer
from rlhf_mc.trainer.recipe import load_recipe
from rlhf_mc.trainer.rollouts import RolloutManager

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


def scripted(generate, prompts, sampling, tokenizer, version=0, empty=()):
    """A rollout function: prompt text "a,b" answers with the texts "a" and "b" (the reward reads them as
    numbers); two tokens each, the second one inserted (a tool's), so only the first is sampled."""
    out = []
    for i, p in enumerate(prompts):
        for text in p.text.split(","):
            sampled = p.text not in empty
            out.append(Sample(i, p.ids + [7, 8], [False] * len(p.ids) + [sampled, False],
                              [0.0] * len(p.ids) + [-0.5, 0.0], [NOT_SAMPLED] * len(p.ids) + [version, NOT_SAMPLED],
                              "stop", text))
    return out


def as_number(response: str, answer: str, prompt: str) -> float:
    return float(response)


def mostly_high(scores: list[float]) -> bool:
    return sum(scores) / len(scores) > 1


def _manager(overrides: list[str]) -> RolloutManager:
    recipe = load_recipe(QUICKSTART, ["sft.data_path=", "data.train_batch_size=2", "rollout.n=2",
                                      "rollout.function=tests.test_rollouts:scripted", *overrides])
    def generate(prompts, sampling, restore):
        raise AssertionError("the scripted rollout function does not generate")

    engines = types.SimpleNamespace(generate=generate)
    return RolloutManager(recipe, engines, types.SimpleNamespace(restore_engine=None), None,
                          RewardScorer("tests.test_rollouts:as_number", workers=1), None)


def _prompts(*texts: str) -> list[Prompt]:
    return [Prompt(row=i, text=t, ids=[1, 2], answer="") for i, t in enumerate(texts)]


def test_dynamic_sampling_with_a_custom_filter_drops_groups_and_refills():
    manager = _manager(["algorithm.dynamic_sampling_max_rounds=3",
                        "algorithm.group_filter=tests.test_rollouts:mostly_high"])
    rounds = iter([_prompts("3,3", "0,4"), _prompts("1,1", "2,2")])
    batch, stats = manager.sample(_prompts("0,1", "5,5"), SamplingParams(n=2), 0, lambda r: next(rounds)[r - 1:],
                                  Timer())
    # round 1 drops "0,1" (mean 0.5), keeps "5,5"; round 2 keeps "3,3" and leaves "0,4" unused (the batch is full)
    assert stats["data/groups_dropped"] == 1 and stats["data/rollout_rounds"] == 2
    assert batch.scores.tolist() == [5.0, 5.0, 3.0, 3.0] and batch.groups.tolist() == [0, 0, 1, 1]
    assert batch.loss_mask.tolist() == [False, False, True, False] * 4
    assert batch.fields["rollout_logprobs"].tolist() == [0.0, 0.0, -0.5, 0.0] * 4


def keep_none(scores: list[float]) -> bool:
    return False


def test_dynamic_sampling_that_runs_out_of_rounds_says_so():
    """A group filter that keeps nothing: after the recipe's rounds the step fails with what was kept and dropped
    (before: one more end-to-end launch, tests/test_trainer.py's DAPO test)."""
    manager = _manager(["algorithm.dynamic_sampling_max_rounds=2",
                        "algorithm.group_filter=tests.test_rollouts:keep_none"])
    with pytest.raises(RuntimeError, match=r"^algorithm.dynamic_sampling_max_rounds: after 2 rounds only 0 of "
                                           r"data.train_batch_size=2 prompts had groups the group filter kept \(4 "
                                           r"groups dropped\)"):
        manager.sample(_prompts("0,1", "5,5"), SamplingParams(n=2), 0, lambda r: _prompts("1,1", "2,2"), Timer())


def test_function_kwargs_reach_the_rollout_function_and_stale_or_empty_samples_are_caught():
    stale = _manager(["rollout.function_kwargs={version: 3}"])
    with pytest.raises(StaleWeights, match="weight versions \\[3\\], expected 0"):
        stale.sample(_prompts("1,2"), SamplingParams(n=2), 0, None, Timer())
    batch, stats = _manager(["rollout.function_kwargs={empty: ['4,4']}"]).sample(
        _prompts("1,2", "4,4"), SamplingParams(n=2), 0, None, Timer())
    assert stats["data/samples_empty"] == 2 and batch.scores.tolist() == [1.0, 2.0]
    # one step off: samples of the version before the trained one pass, older ones do not
    one_step_off = ["rollout.mode=one_step_off", "rollout.function_kwargs={version: 3}"]
    _, stats = _manager(one_step_off).sample(_prompts("1,2"), SamplingParams(n=2), 4, None, Timer())
    assert stats["rollout/staleness_mean"] == stats["rollout/staleness_max"] == 1
    with pytest.raises(StaleWeights, match="weight versions \\[3\\], expected 4..5"):
        _manager(one_step_off).sample(_prompts("1,2"), SamplingParams(n=2), 5, None, Timer())


@pytest.mark.parametrize("overrides, message", [
    (["rollout.function=tests.test_rollouts:nope"], "rollout.function: cannot import 'tests.test_rollouts:nope'"),
    (["algorithm.group_filter=tests.test_rollouts:mostly_high"],
     "group_filter: 'tests.test_rollouts:mostly_high' is read only with dynamic sampling on"),
])
def test_bad_plugins_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _manager(overrides)
