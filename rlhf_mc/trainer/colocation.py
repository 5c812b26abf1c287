"""The memory moves around weight sync and rollout when the trainer and the engines share devices, in one place.

Colocated order (slime's, with verl's split of the engine's resume), from the end of an update to the next one:
  offload gradients + optimizer state (actor.offload), and the whole state of the other offloaded groups
  -> resume the engines' weights -> sync -> offload the actor's weights (actor.offload) -> resume the engines' KV
  cache -> rollout -> release the engines' memory -> reload what was offloaded.
So the training state and the engines' memory are never on a device together: the sync meets the engines' weights
with the actor's weights only, the rollout meets the KV cache with nothing of the trainer's. Disaggregated placement
(or attached engines): only the sync. Colocated on CPU, where an engine's release frees nothing (Plan.
engines_release_memory), the engines keep their memory and only what the recipe offloads moves.

Engine failures: a sync that fails on an engine restarts that engine and syncs it again; an engine restarted since
the last sync, or during a rollout, is given the actor's current weights before it serves (restore_engine),
labelled with their version. In the off-policy modes rollouts run while the actor trains: a restore then waits
until the trainer's thread leaves the actor (actor_in_use), so that it never takes half-updated weights and every
actor rank sees the collectives of both threads in one order.
"""

from __future__ import annotations

import threading

from rlhf_mc.rollout.sglang_engine import KV_CACHE_TAGS, WEIGHTS_TAGS
from rlhf_mc.trainer.metrics import Timer
from rlhf_mc.trainer.placement import Cluster, WorkerGroup


class ColocationSchedule:
    def __init__(self, cluster: Cluster, actor: WorkerGroup, actor_offload: bool, offloaded: list[WorkerGroup],
                 colocated: bool, release_engines: bool):
        """`offloaded`: the other groups (critic, separate reference) whose whole state leaves the devices.
        `release_engines`: the engines release their memory (colocated on GPUs)."""
        self.cluster, self.actor, self.actor_offload = cluster, actor, actor_offload and colocated
        self.offloaded = offloaded if colocated else []
        self.colocated, self.release_engines = colocated, release_engines
        self.actor_version = None  # the version of the weights the actor holds
        self._actor = threading.RLock()  # held by whoever calls the actor (trainer/loop.py, restore_engine)

    def actor_in_use(self) -> threading.RLock:
        """Held around the trainer's calls of the actor; a restore waits for it."""
        return self._actor

    def actor_trained(self, version: int) -> None:
        """The actor's update made weights `version` (the engines get them at the next before_rollout)."""
        self.actor_version = version

    def before_rollout(self, version: int, timer: Timer) -> dict:
        """After an update (or at the start): everything up to the rollout. Returns the sync's metrics."""
        if self.colocated:
            with timer("offload"):
                if self.actor_offload:
                    self.actor.offload("optimizer")
                for group in self.offloaded:
                    group.offload("all")
        if self.release_engines:
            self.cluster.engines_call("resume_memory", WEIGHTS_TAGS)
        with timer("sync"):
            metrics = self._sync(version)
        if self.colocated:
            if self.actor_offload:
                with timer("offload"):
                    self.actor.offload("weights")
        if self.release_engines:
            self.cluster.engines_call("resume_memory", KV_CACHE_TAGS)
        return metrics

    def after_rollout(self, timer: Timer) -> None:
        if self.release_engines:
            self.cluster.engines_call("release_memory")
        if self.colocated:
            with timer("reload"):
                if self.actor_offload:
                    self.actor.reload()
                for group in self.offloaded:
                    group.reload()

    def finish(self) -> None:
        """After the last step: the training state back on the devices (for the final export)."""
        if self.actor_offload:
            self.actor.reload()
        for group in self.offloaded:
            group.reload()

    def restore_engine(self, engine: int) -> None:
        """A restarted engine gets the actor's weights as they are, with their version (the actor's own come back
        from host memory for the time it takes); during an update, once it is done."""
        with self._actor:
            if self.actor_offload:
                self.actor.reload("weights")
            try:
                self._sync(self.actor_version, [engine])
            finally:
                if self.actor_offload:
                    self.actor.offload("weights")

    def _sync(self, version: int, engines: list[int] | None = None) -> dict:
        """The actor's weights into the engines (or `engines`); an engine that fails is restarted and synced again,
        once. Returns rank 0's figures, the largest peak over ranks, the engines' restart count."""
        self.actor_version = version
        stats = self.actor.sync(version, engines)
        failed = {e: error for s in stats for e, error in s.failed.items()}
        if failed:
            self.cluster.recover_engines(sorted(failed))
            self.actor.reconnect_engines()
            again = self.actor.sync(version, sorted(failed))
            still = {e: error for s in again for e, error in s.failed.items()}
            if still:
                raise RuntimeError(f"weight sync to version {version} failed on engines {still} after a restart")
        self.cluster.engines_synced(engines)
        first = stats[0]
        return {"sync/seconds": first.seconds, "sync/bytes": first.bytes,
                "sync/peak_extra_mb": max(s.peak_extra_mb for s in stats), "sync/failed_engines": len(failed)}
