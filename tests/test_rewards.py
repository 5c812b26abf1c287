"""Rule rewards on hand-written cases; reward functions by import path; failures and timeouts are scored and
counted, and the batch still completes."""

from __future__ import annotations

import time

import pytest

from rlhf_mc.config import ConfigError
from rlhf_mc.rewards.rules import extract_answer, format_reward, math_and_format_reward, math_reward, normalize
from rlhf_mc.rewards.scoring import RewardScorer, resolve


@pytest.mark.parametrize("text, answer", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("so the total is \\boxed{\\frac{1}{2}} and not 3", "\\frac{1}{2}"),
    ("nested \\boxed{2^{10}} ok", "2^{10}"),
    ("first 12 then 1,234.50 dollars.", "1,234.50"),
    ("no number here", None),
    ("####", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("raw, norm", [("1,000", "1000"), ("$42.", "42"), ("3/6", "1/2"), ("2.50", "5/2"),
                                       ("-0.0", "0"), ("\\text{yes}", "yes"), (" 7 ", "7")])
def test_normalize(raw, norm):
    assert normalize(raw) == norm


def test_math_reward():
    assert math_reward("the answer is 1,000", "1000") == 1.0
    assert math_reward("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72") == 1.0  # GSM8K ground truth format
    assert math_reward("#### 71", "#### 72") == 0.0
    assert math_reward("I don't know", "5") == 0.0
    assert math_reward("85", "85") == 1.0 and math_reward("850", "85") == 0.0


def test_format_rewards():
    assert format_reward("reasoning...\n#### 5") == 1.0
    assert format_reward("5") == 0.0
    assert format_reward("<a>x</a>", pattern=r"<a>.*</a>") == 1.0
    assert math_and_format_reward("so\n#### 5", "5") == pytest.approx(1.1)
    assert math_and_format_reward("5", "5", format_weight=0.5) == 1.0


def slow_reward(response: str, answer: str, prompt: str) -> float:
    if response == "hang":
        time.sleep(3)
    if response == "boom":
        raise ValueError("broken reward")
    return float(response == answer)


def test_scorer_contains_failures_and_timeouts():
    scorer = RewardScorer("tests.test_rewards:slow_reward", timeout_s=1.0, failure_score=-1.0)
    start = time.perf_counter()
    scores, stats = scorer.score(["1", "boom", "hang", "2"], ["1", "1", "1", "1"], ["p"] * 4)
    assert time.perf_counter() - start < 2.5
    assert scores == [1.0, -1.0, -1.0, 0.0]
    assert stats == {"reward/failures": 1, "reward/timeouts": 1}


def test_scorer_kwargs_and_builtin():
    scorer = RewardScorer("math_and_format", kwargs={"format_weight": 0.5})
    assert scorer.score(["x\n#### 3"], ["3"], [""])[0] == [1.5]
    assert resolve("tests.test_rewards:slow_reward")("2", "2", "") == 1.0
    with pytest.raises(ConfigError, match="reward.function: cannot import 'tests.test_rewards:nope'"):
        resolve("tests.test_rewards:nope")
    with pytest.raises(ConfigError, match="is not callable"):
        resolve("tests.test_rewards:__name__")


def final_answer_after_a_tool(response: str, answer: str, prompt: str, messages: list[dict]) -> float:
    """A multi-turn reward: the answer counts only after a calculator call."""
    return float(response == answer and any(m["role"] == "tool" for m in messages or []))


def test_functions_with_a_messages_parameter_get_the_exchange():
    exchange = [{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "42"}]
    scorer = RewardScorer("tests.test_rewards:final_answer_after_a_tool")
    assert scorer.score(["42", "42"], ["42", "42"], ["", ""], [exchange, exchange[2:]])[0] == [1.0, 0.0]
    # functions without the parameter are called as before
    assert RewardScorer("math").score(["42"], ["42"], [""], [exchange])[0] == [1.0]
