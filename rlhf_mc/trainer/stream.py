"""Async mode's rollouts (rollout.mode=async): groups - one prompt's rollout.n samples - generated without pause while
the actor trains, admitted under the staleness bound, and handed to the trainer in the data order.

Admission (AReaL's rule, in groups): group g, the g-th of the run's data order (step g // B, B =
data.train_batch_size), starts only once g + 1 <= (version + max_staleness + 1) * B, `version` being the weights the
engines hold. The trainer takes the groups of step s in that order, so a group g of step s (s * B <= g) was admitted
at a version v with (v + max_staleness + 1) * B >= g + 1 > s * B, that is v >= s - max_staleness, and every one of
its tokens comes from v or later: staleness is bounded at admission, and no work is discarded. Taking the groups in
order, not as they finish, makes a step's batch the prompts it has in sync mode and the bound exact; the price is
that a step waits for its slowest group, while the engines go on with the groups of the next max_staleness steps. A
weight sync pauses the groups under way (SGLang's retract: rollout/sglang_engine.py pause) and they go on with the
new weights (partial rollouts), each token labelled with the version that produced it.

At a stop the groups under way are dropped: a resumed run starts the stream again at its checkpoint's step.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rlhf_mc.data.dataset import Prompt
from rlhf_mc.data.trajectory import Sample
from rlhf_mc.rollout.base import SamplingParams


class RolloutStream:
    def __init__(self, rollout: Callable[..., list[Sample]], prompts_for_step: Callable[[int], list[Prompt]],
                 sampling: SamplingParams, batch_size: int, max_staleness: int, first_step: int, total_steps: int):
        """`rollout(prompts, sampling, first_session)`: the rollout function (RolloutManager.rollout);
        `prompts_for_step(s)`: step s's B prompts in order. Nothing starts before weights_updated."""
        self.rollout, self.prompts_for_step, self.sampling = rollout, prompts_for_step, sampling
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.next_group, self.end = first_step * batch_size, total_steps * batch_size
        self.done: dict[int, tuple[list[Sample], float, float] | BaseException] = {}
        self._spans: list[tuple[float, float]] = []  # when the finished groups generated (engines' idle time)
        self._running: dict[int, float] = {}  # group -> when it started
        self._prompts: dict[int, list[Prompt]] = {}
        self._finished = threading.Condition()
        # never more than (max_staleness + 1) * B groups between admission and the trainer
        self._pool = ThreadPoolExecutor((max_staleness + 1) * batch_size, thread_name_prefix="rollout-group")

    def weights_updated(self, version: int) -> None:
        """The engines hold `version` now: the groups the bound admits at it start."""
        limit = min(self.end, (version + self.max_staleness + 1) * self.batch_size)
        while self.next_group < limit:
            step, position = divmod(self.next_group, self.batch_size)
            if step not in self._prompts:
                self._prompts[step] = self.prompts_for_step(step)
            self._pool.submit(self._generate, self.next_group, self._prompts[step][position])
            self.next_group += 1

    def _generate(self, group: int, prompt: Prompt) -> None:
        start = time.perf_counter()
        with self._finished:
            self._running[group] = start
        try:
            samples = self.rollout([prompt], self.sampling, group)
            for s in samples:
                s.prompt_index = group % self.batch_size
            result: tuple[list[Sample], float, float] | BaseException = (samples, start, time.perf_counter())
        except BaseException as error:  # noqa: BLE001 - raised in the trainer's thread by take()
            result = error
        with self._finished:
            self.done[group] = result
            self._spans.append((self._running.pop(group), time.perf_counter()))
            self._finished.notify_all()

    def busy_since(self, since: float) -> list[tuple[float, float]]:
        """When groups generated, from `since` on (those under way until now); older spans are forgotten."""
        now = time.perf_counter()
        with self._finished:
            self._spans = [(a, b) for a, b in self._spans if b >= since]
            return self._spans + [(start, now) for start in self._running.values()]

    def take(self, step: int) -> tuple[list[Prompt], list[Sample], float]:
        """Step `step`'s prompts and samples (in prompt order), once all its groups are done, and the seconds from
        the first one's start to the last one's end. Raises what a group's rollout raised."""
        groups = range(step * self.batch_size, (step + 1) * self.batch_size)
        with self._finished:
            self._finished.wait_for(lambda: all(g in self.done for g in groups))
            results = [self.done.pop(g) for g in groups]
        for result in results:
            if isinstance(result, BaseException):
                raise result
        span = max(end for _, _, end in results) - min(start for _, start, _ in results)
        return self._prompts.pop(step), [s for samples, _, _ in results for s in samples], span

    def close(self) -> None:
        """Drops the groups not started; those under way end in their threads (their results are not read)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
