"""Async mode's admission and ordering (trainer/stream.py), with a rollout function the test finishes by hand: the
bound (version + max_staleness + 1) * B on the groups admitted, the steps' batches in the data order whatever the
order the groups finish in, failures raised to the trainer. The engines' side runs in tests/test_trainer.py."""

from __future__ import annotations

import threading
import time

import pytest

from rlhf_mc.data.dataset import Prompt
from rlhf_mc.data.trajectory import Sample
from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.trainer.metrics import Timer
from rlhf_mc.trainer.stream import RolloutStream

B = 4


class HandRollouts:
    """Records each group's start (and the version the test had given the stream then); a group ends when the test
    releases it."""

    def __init__(self):
        self.version, self.started, self.release = 0, {}, {}
        self.lock = threading.Lock()

    def __call__(self, prompts: list[Prompt], sampling: SamplingParams, group: int) -> list[Sample]:
        with self.lock:
            self.started[group] = self.version
            self.release[group] = threading.Event()
        self.release[group].wait(30)
        if prompts[0].text == "fail":
            raise ValueError(f"group {group} failed")
        return [Sample(0, prompts[0].ids, [False, True], [0.0, -1.0], [-1, group], "stop", prompts[0].text)
                for _ in range(sampling.n)]

    def wait_started(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.started) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # and no more
        assert len(self.started) == count, sorted(self.started)


def prompts_for_step(step: int) -> list[Prompt]:
    return [Prompt(i, f"step {step} prompt {i}", [1, 2], "") for i in range(B)]


def stream(rollouts: HandRollouts, max_staleness: int, first_step: int = 0, total_steps: int = 5) -> RolloutStream:
    return RolloutStream(rollouts, prompts_for_step, SamplingParams(n=2), B, max_staleness, first_step, total_steps)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_groups_are_admitted_within_the_bound_and_taken_in_order(max_staleness):
    rollouts = HandRollouts()
    s = stream(rollouts, max_staleness)
    try:
        for step in range(5):
            rollouts.version = step
            s.weights_updated(step)
            admitted = min(5, step + max_staleness + 1) * B  # the bound, and the run's last step
            rollouts.wait_started(admitted)
            for group in reversed(range(step * B, (step + 1) * B)):  # the step's groups end last-first
                rollouts.release[group].set()
            prompts, samples, _ = s.take(step)
            assert [p.text for p in prompts] == [p.text for p in prompts_for_step(step)]
            assert [(x.prompt_index, x.text, x.versions[1]) for x in samples] == [
                (i, f"step {step} prompt {i}", step * B + i) for i in range(B) for _ in range(2)]
        for group, version in rollouts.started.items():  # every group started at a version the bound allows
            assert group + 1 <= (version + max_staleness + 1) * B
            assert version >= group // B - max_staleness
    finally:
        for event in rollouts.release.values():
            event.set()
        s.close()


def test_a_resumed_stream_starts_at_its_step_and_failures_reach_the_trainer():
    rollouts = HandRollouts()
    s = RolloutStream(rollouts, lambda step: [Prompt(i, "fail" if i == 2 else "ok", [1, 2], "") for i in range(B)],
                      SamplingParams(n=1), B, 1, first_step=3, total_steps=10)
    try:
        s.weights_updated(3)
        rollouts.wait_started(2 * B)
        assert sorted(rollouts.started) == list(range(3 * B, 5 * B))
        for event in rollouts.release.values():
            event.set()
        with pytest.raises(ValueError, match="group 14 failed"):
            s.take(3)
    finally:
        s.close()


def test_a_restarted_engine_waits_for_the_update_and_gets_the_updated_weights_version():
    """An engine restarted while the trainer's thread uses the actor (an update in the off-policy modes) is restored
    once the trainer lets go of it, with the weights the actor holds then and their version - never mid-update
    weights under the version before."""
    from rlhf_mc.sync.weights import SyncStats
    from rlhf_mc.trainer.colocation import ColocationSchedule

    class Actor:  # records what it was asked to sync, and whether the trainer was using it at that moment
        def __init__(self):
            self.synced = []

        def sync(self, version, engines=None):
            self.synced.append((version, engines, schedule.actor_in_use()._is_owned()))
            return [SyncStats(version, 0, 0, 0, 0.0, 0.0)]

    class Cluster:
        def engines_synced(self, engines=None):
            pass

    actor = Actor()
    schedule = ColocationSchedule(Cluster(), actor, actor_offload=False, offloaded=[], colocated=False,
                                  release_engines=False)
    schedule.before_rollout(0, Timer())
    restored = threading.Thread(target=schedule.restore_engine, args=(1,))
    with schedule.actor_in_use():  # the update of step 0
        restored.start()
        time.sleep(0.2)
        assert restored.is_alive() and actor.synced == [(0, None, False)]
        schedule.actor_trained(1)
    restored.join(5)
    assert actor.synced[1] == (1, [1], True)  # version 1, engine 1, under the lock (taken by the restore)
