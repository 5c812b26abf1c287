"""Scores responses with a reward function chosen by name (rules.BUILTIN) or import path ("pkg.module:function").
A function that raises or exceeds its timeout gives the sample `failure_score` and is counted; the run goes on."""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
from typing import Callable

from rlhf_mc.config import builtin_or_import
from rlhf_mc.rewards.rules import BUILTIN

log = logging.getLogger(__name__)


def resolve(name: str) -> Callable[..., float]:
    return builtin_or_import("reward.function", name, BUILTIN)


class RewardScorer:
    def __init__(self, function: str, kwargs: dict | None = None, timeout_s: float = 10.0,
                 failure_score: float = 0.0, workers: int = 4):
        self.fn, self.kwargs = resolve(function), dict(kwargs or {})
        # multi-turn trajectories: a function with a `messages` parameter also gets the exchange after the prompt
        self.takes_messages = "messages" in inspect.signature(self.fn).parameters
        self.timeout_s, self.failure_score = timeout_s, failure_score
        # Threads: a hung call cannot be killed, but it no longer holds up the run (its slot stays taken).
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")

    def score(self, responses: list[str], answers: list[str], prompts: list[str],
              messages: list[list[dict] | None] | None = None) -> tuple[list[float], dict]:
        """(scores, {"reward/failures": n, "reward/timeouts": n})."""
        extra = [{"messages": m} for m in messages] if self.takes_messages and messages else [{}] * len(responses)
        futures = [self.pool.submit(self.fn, r, a, p, **self.kwargs, **e)
                   for r, a, p, e in zip(responses, answers, prompts, extra)]
        scores, failures, timeouts = [], 0, 0
        done, _ = concurrent.futures.wait(futures, timeout=self.timeout_s)
        for future in futures:
            if future not in done:
                timeouts += 1
                future.cancel()
                scores.append(self.failure_score)
                continue
            try:
                scores.append(float(future.result()))
            except Exception as e:  # noqa: BLE001 - a user function's failure is scored, not fatal
                failures += 1
                if failures == 1:
                    log.warning("reward function failed: %r", e)
                scores.append(self.failure_score)
        return scores, {"reward/failures": failures, "reward/timeouts": timeouts}
