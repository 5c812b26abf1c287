"""Ray placement: a local Ray instance or a cluster; one placement group with a bundle per device; Megatron worker
groups (one Ray actor per rank, one rank per bundle) and SGLang engines (one Ray actor per engine, which launches
the server on its node), colocated with the training ranks or on bundles of their own."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rlhf_mc.config import ModelConfig, ParallelConfig, RolloutConfig
from rlhf_mc.trainer.recipe import Plan, Recipe


def start_ray(address: str | None, plan: Plan) -> None:
    """Joins the cluster at `address` (or RAY_ADDRESS); otherwise starts a local instance with one logical CPU per
    device (ranks on a CPU machine take a CPU each, whatever the core count)."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return
    cpus = max(os.cpu_count() or 1, plan.devices + 1)
    ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=env, log_to_driver=True,
             _temp_dir=os.environ.get("RLHF_MC_RAY_TMP"))


class WorkerGroup:
    """The ranks of one Megatron model (actor, critic or reference). Calls go to every rank and return every
    rank's answer."""

    def __init__(self, name: str, pg, bundles: list[int], model: ModelConfig, parallel: ParallelConfig, dtype: str,
                 seed: int, gpu: bool, recompute: str = "none", value_head: bool = False):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_mc.trainer.worker import ModelWorker

        def strategy(bundle: int):
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

        # Several groups share a bundle (colocated roles: actor, critic, reference, reward model, engine): each rank
        # takes a small fraction of its device, so that all fit.
        share = 0.1
        remote = ray.remote(ModelWorker).options
        world = len(bundles)
        self.workers = [remote(name=f"{name}-rank{rank}", num_cpus=share, num_gpus=share if gpu else 0,
                               scheduling_strategy=strategy(b)).remote(
            rank, world, model, parallel, dtype, seed, recompute, value_head)
            for rank, b in enumerate(bundles)]
        master = ray.get(self.workers[0].store_address.remote())
        self.call("start", master)

    def call(self, method: str, *args, **kwargs) -> list:
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def gathered(self, method: str, n: int, *args, **kwargs) -> list:
        """For methods answering (indices, per-sequence results) on reporting ranks: results in batch order."""
        out: list = [None] * n
        for answer in self.call(method, *args, **kwargs):
            if answer is not None:
                for i, value in zip(*answer):
                    out[i] = value
        return out

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)


class EngineWorker:
    """Owns one launched SGLang engine (restarts included) on its node."""

    def __init__(self, cfg: RolloutConfig, log_dir: str, visible_devices: str | None):
        import ray

        from rlhf_mc.rollout.sglang_engine import SGLangEngine

        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        cfg = dataclasses.replace(cfg, num_engines=1, host=ray.util.get_node_ip_address())
        self.engine = SGLangEngine(cfg, log_dir=log_dir)

    def address(self) -> str:
        return self.engine.urls[0].removeprefix("http://")

    def generate(self, prompts, sampling):
        return self.engine.generate(prompts, sampling)

    def call(self, method: str, *args):
        return getattr(self.engine, method)(*args)


class Cluster:
    """The placement group and what runs on it."""

    def __init__(self, recipe: Recipe, plan: Plan, address: str | None = None):
        import ray
        from ray.util.placement_group import placement_group

        start_ray(address, plan)
        self.recipe, self.plan, self.gpu = recipe, plan, plan.device == "cuda"
        bundle = {"CPU": 1, **({"GPU": 1} if self.gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(plan.devices)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=600)
        self.train_bundles = list(range(plan.actor_world))
        self.engines: list = []

    def bundle_nodes(self) -> dict[int, str]:
        """The Ray node id of each bundle (device), as placed."""
        import ray

        table = ray.util.placement_group_table(self.pg)
        return {int(b): node for b, node in table["bundles_to_node_id"].items()}

    def worker_group(self, name: str, model: ModelConfig, parallel: ParallelConfig, value_head: bool = False,
                     recompute: str = "none") -> WorkerGroup:
        return WorkerGroup(name, self.pg, self.train_bundles, model, parallel, self.recipe.model.dtype,
                           self.recipe.trainer.seed, self.gpu, recompute, value_head)

    def start_engines(self, model_path: str, log_dir: Path) -> list[str]:
        """Launches the SGLang engines from an HF checkpoint; returns their addresses."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = dataclasses.replace(self.recipe.rollout.engine, model_path=model_path)
        colocated = self.recipe.rollout.placement == "colocated"
        first = 0 if colocated else self.plan.actor_world
        remote = ray.remote(EngineWorker).options
        for e in range(cfg.num_engines):
            bundle = first + e * cfg.tp
            visible = None
            if self.gpu:  # the engine's tp devices: the GPU ids Ray gave bundles [bundle, bundle + tp)
                ids = ray.get([ray.remote(lambda: ray.get_gpu_ids()).options(
                    num_cpus=0, num_gpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=b)).remote()
                    for b in range(bundle, bundle + cfg.tp)])
                visible = ",".join(str(int(i[0])) for i in ids)
            self.engines.append(remote(num_cpus=0.05, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle)).remote(
                cfg, str(log_dir / f"engine{e}"), visible))
        return ray.get([engine.address.remote() for engine in self.engines])

    def generate(self, prompts: list[list[int]], sampling) -> list:
        """Prompts dealt round-robin to the engines; samples in (prompt, sample) order."""
        import ray

        shares = [list(range(e, len(prompts), len(self.engines))) for e in range(len(self.engines))]
        answers = ray.get([engine.generate.remote([prompts[i] for i in share], sampling)
                           for engine, share in zip(self.engines, shares) if share])
        samples = []
        for share, answer in zip(shares, answers):
            for s in answer:
                s.prompt_index = share[s.prompt_index]
                samples.append(s)
        samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return samples

    def engines_call(self, method: str, *args) -> list:
        import ray

        return ray.get([engine.call.remote(method, *args) for engine in self.engines])

    def shutdown(self) -> None:
        import ray

        for engine in self.engines:
            try:
                ray.get(engine.call.remote("shutdown"), timeout=60)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            ray.kill(engine)
        self.engines = []
