"""Ray placement: a local Ray instance or a cluster; one placement group with a bundle per device, ordered by node
and GPU (device slot d is the d-th bundle in that order, so consecutive slots share a node); Megatron worker groups
(one Ray actor per rank, rank r on slot r) and SGLang engines (one Ray actor per engine, which launches the server
on its node), colocated with the training ranks or on slots of their own, or attached by address.

Data goes to a worker group by reference: the driver splits a batch into the data-parallel shares, puts each into
the object store once, and every rank of a data-parallel group fetches only its own share.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from rlhf_mc.config import ConfigError, LoraConfig, ModelConfig, ParallelConfig, RolloutConfig, RouterConfig
from rlhf_mc.data.microbatch import balance_across_ranks
from rlhf_mc.data.trajectory import Trajectories, gather_shares
from rlhf_mc.runtime import host, ray_tensors
from rlhf_mc.trainer.plan import Plan
from rlhf_mc.trainer.recipe import Recipe

log = logging.getLogger("rlhf_mc.trainer")


def start_ray(address: str | None, plan: Plan) -> None:
    """Joins the cluster at `address` (or RAY_ADDRESS); otherwise starts a local instance with one logical CPU per
    device (ranks on a CPU machine take a CPU each, whatever the core count). The caller's SIGTERM handler stays:
    Ray's driver puts one in place that aborts the process, which would skip every clean-up. The workers of a local
    CPU instance get host.exec_env (MKL's AVX-512 kernels on an AMD CPU; a cluster's nodes would each need the
    library this node built). The workers' output is not streamed to the driver's console: each rank and engine
    writes its own into the run's logs/ folder (console.output_to). Tensors go to and from the ranks as their bytes
    (runtime/ray_tensors.py)."""
    import ray

    if ray.is_initialized():
        ray_tensors.register()
        return
    env = {"env_vars": {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}}
    address = address or os.environ.get("RAY_ADDRESS")
    if not address and plan.device == "cpu":
        env["env_vars"].update(host.exec_env(os.environ))
    on_term = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        cpus = max(os.cpu_count() or 1, plan.devices + 1)
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=env, log_to_driver=False,
                 _temp_dir=os.environ.get("RLHF_MC_RAY_TMP"))
    if on_term is not None:
        signal.signal(signal.SIGTERM, on_term)
    ray_tensors.register()


def check_groups_on_one_node(plan: Plan, slot_nodes: list[str], devices_per_node: int) -> None:
    """Each TP group and each engine on one node, as the plan laid them out; Ray may have packed the nodes
    otherwise (nodes with other GPU counts than resources.devices_per_node). `slot_nodes[d]`: device slot d's node."""
    groups = [(f"{role} tensor-parallel group", range(start, start + tp))
              for role, tp, world in plan.tp_groups for start in range(0, world, tp)]
    groups += [(f"rollout engine {e}", range(first, first + n)) for e, (first, n) in enumerate(plan.engines)]
    for what, slots in groups:
        nodes = {slot_nodes[s] for s in slots}
        if len(nodes) > 1:
            raise ConfigError(f"resources: Ray placed the {what} (devices {slots.start}-{slots.stop - 1}) on "
                              f"{len(nodes)} nodes {sorted(nodes)}; give every node resources.devices_per_node="
                              f"{devices_per_node} GPUs")


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Where a rank sits in its group's Megatron layout, as the driver needs it."""

    dp_rank: int
    dp_size: int
    reports: bool  # first TP and CP rank of the last pipeline stage: holds its data-parallel share's results


class WorkerGroup:
    """The ranks of one Megatron model (actor, critic, reference or reward model)."""

    def __init__(self, name: str, pg, bundles: list[int], model: ModelConfig, parallel: ParallelConfig, dtype: str,
                 seed: int, gpu: bool, recompute: str = "none", value_head: bool = False,
                 router: RouterConfig = RouterConfig(), log_dir: Path | None = None, lora: LoraConfig = LoraConfig()):
        """`log_dir`: each rank's output goes to <log_dir>/<name>-rank<r>.log."""
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
            rank, world, model, parallel, dtype, seed, recompute, value_head, router,
            str(log_dir / f"{name}-rank{rank}.log") if log_dir else None, lora)
            for rank, b in enumerate(bundles)]
        master = ray.get(self.workers[0].store_address.remote())
        self.layout: list[RankLayout] = [RankLayout(**x) for x in self._call("start", master)]
        self.dp = self.layout[0].dp_size
        # The rank whose answer stands for the group (metrics reduced over data-parallel ranks): data-parallel
        # rank 0's reporting rank.
        self.reporter = next(r for r, x in enumerate(self.layout) if x.reports and x.dp_rank == 0)

    # ------------------------------------------------------------ the role's calls (ModelWorker's, on every rank)

    def load_hf(self, path: str, value_head_from: str | None = None) -> None:
        self._call("load_hf", path, value_head_from)

    def load_adapter(self, path: str) -> None:
        self._call("load_adapter", path)

    def setup_optimizer(self, optim) -> None:
        self._call("setup_optimizer", optim)

    def keep_reference(self) -> None:
        """The current weights become the frozen reference (host memory) that ref_logprobs swaps in."""
        self._call("keep_reference")

    def save(self, path: str, trainer_state: dict | None = None) -> None:
        self._call("save", path, trainer_state)

    def load(self, path: str) -> dict:
        """Restores a checkpoint; its trainer state."""
        return self._call("load", path)[self.reporter]

    def export_hf(self, path: str, config: dict, tokenizer_dir: str | None) -> None:
        self._call("export_hf", path, config, tokenizer_dir)

    def export_adapter(self, path: str, base_model: str) -> None:
        self._call("export_adapter", path, base_model)

    def offload(self, part: str = "all") -> None:
        self._call("offload", part)

    def reload(self, part: str | None = None) -> None:
        self._call("reload", part)

    def prepare_sync(self) -> None:
        self._call("prepare_sync")

    def connect_engines(self, addresses: list[str], transport: str, bucket_bytes: int,
                        engine_ranks: list[list[int]] | None, config_from: str, staging_dir: str) -> None:
        self._call("connect_engines", addresses, transport, bucket_bytes, engine_ranks, config_from, staging_dir)

    def reconnect_engines(self) -> None:
        self._call("reconnect_engines")

    def sync(self, version: int, engines: list[int] | None = None) -> list:
        """The weights into the engines (or `engines`) as `version`: every rank's sync.weights.SyncStats."""
        return self._call("sync", version, engines)

    def logprobs(self, batch: Trajectories, temperature: float, micro_batch_tokens: int,
                 with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Per token of the batch, "logprobs" (and "entropy") under the model."""
        return self._forward("logprobs", batch, temperature=temperature, with_entropy=with_entropy,
                             micro_batch_tokens=micro_batch_tokens)

    def ref_logprobs(self, batch: Trajectories, temperature: float, micro_batch_tokens: int
                     ) -> dict[str, torch.Tensor]:
        """logprobs under the reference kept by keep_reference (swapped into this group's modules)."""
        return self._forward("ref_logprobs", batch, temperature=temperature, micro_batch_tokens=micro_batch_tokens)

    def values(self, batch: Trajectories, micro_batch_tokens: int) -> dict[str, torch.Tensor]:
        """Per token of the batch, "values": the value head's estimate of the state before it."""
        return self._forward("values", batch, micro_batch_tokens=micro_batch_tokens)

    def score(self, sequences: list[list[int]]) -> list[float]:
        """A reward model's score of each sequence: the head's output at its last token (the value "before" one
        appended token)."""
        batch = Trajectories.single_turn([q + [0] for q in sequences], [len(q) for q in sequences])
        values = self._forward("values", batch)["values"]
        return values[torch.tensor(batch.offsets[1:]) - 1].tolist()

    def train_policy(self, batch: Trajectories, mini_batches: int, epochs: int, loss_cfg, temperature: float,
                     micro_batch_tokens: int) -> dict:
        """The actor's optimizer steps on the batch (workers/train.train_step); the metrics."""
        return self._update("actor", batch, mini_batches, epochs=epochs, loss_cfg=loss_cfg, temperature=temperature,
                            micro_batch_tokens=micro_batch_tokens)

    def train_values(self, batch: Trajectories, mini_batches: int, epochs: int, loss_cfg, micro_batch_tokens: int,
                     value_clip: float) -> dict:
        """The critic's optimizer steps (workers/train.critic_train_step); the metrics."""
        return self._update("critic", batch, mini_batches, epochs=epochs, loss_cfg=loss_cfg,
                            micro_batch_tokens=micro_batch_tokens, value_clip=value_clip)

    def train_sft(self, batch: Trajectories, micro_batch_tokens: int) -> dict:
        """One SFT optimizer step on the batch (workers/train.sft_step); the metrics."""
        return self._update("sft", batch, 1, micro_batch_tokens=micro_batch_tokens)

    # ------------------------------------------------------------ how calls reach the ranks

    def _call(self, method: str, *args, **kwargs) -> list:
        """`method` on every rank with the same arguments; every rank's answer."""
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def _by_share(self, method: str, shares: list, *args, **kwargs) -> list:
        """`method(share, ...)` on every rank, each given its data-parallel rank's share (one object in the store,
        fetched by the ranks of that data-parallel group only)."""
        import ray

        refs = [ray.put(share) for share in shares]
        return ray.get([getattr(w, method).remote(refs[x.dp_rank], *args, **kwargs)
                        for w, x in zip(self.workers, self.layout)])

    def _forward(self, kind: str, batch: Trajectories, **kwargs) -> dict[str, torch.Tensor]:
        """ModelWorker.forward's per-token results (log-probs, reference log-probs or values) of the whole batch."""
        shares = balance_across_ranks(batch.lengths.tolist(), self.dp)
        answers = self._by_share("forward", [batch.select(share) for share in shares], kind, **kwargs)
        reported = {x.dp_rank: answer for x, answer in zip(self.layout, answers) if x.reports}
        return {k: gather_shares(batch, shares, [reported[d][k] for d in range(self.dp)]) for k in reported[0]}

    def _update(self, kind: str, batch: Trajectories, mini_batches: int, **kwargs) -> dict:
        """ModelWorker.update over `mini_batches` consecutive mini-batches of the batch (each split over the
        data-parallel ranks); the metrics."""
        n = len(batch)
        per_rank: list[list[Trajectories]] = [[] for _ in range(self.dp)]
        for m in range(mini_batches):
            index = list(range(m * n // mini_batches, (m + 1) * n // mini_batches))
            for d, share in enumerate(balance_across_ranks(batch.lengths[index].tolist(), self.dp)):
                per_rank[d].append(batch.select([index[i] for i in share]))
        return self._by_share("update", per_rank, kind, **kwargs)[self.reporter]

    def shutdown(self) -> None:
        """Ends the workers (ModelWorker.exit: their shared memory removed first); kills what did not end in 10 s."""
        import ray

        ray.wait([w.exit.remote() for w in self.workers], num_returns=len(self.workers), timeout=10)
        for w in self.workers:
            ray.kill(w)
        self.workers = []


class EngineWorker:
    """Owns one SGLang engine on its node: launched (restarts included) or attached. A threaded Ray actor, so that
    the driver can ask whether a restarted engine waits for weights while a generate call blocks on it."""

    def __init__(self, cfg: RolloutConfig, log_dir: str, visible_devices: str | None, host: str,
                 colocated: bool = False, first_slot: int = 0, slots_on_host: int = 1):
        """`first_slot`: the engine's first device slot on its node of `slots_on_host` (its cores on CPU)."""
        from rlhf_mc.rollout.sglang_engine import SGLangEngine
        from rlhf_mc.runtime import console

        console.output_to(Path(log_dir) / "engine_worker.log")
        if visible_devices is not None:  # its own GPUs alone are visible: its slots are 0 .. tp - 1 of them
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
            first_slot, slots_on_host = 0, cfg.tp
        self.engine = SGLangEngine(dataclasses.replace(cfg, num_engines=1, host=host), log_dir=log_dir,
                                   memory_saver=colocated, first_slot=first_slot, slots_on_host=slots_on_host)
        self.engine.on_restart = self._on_restart
        self.stale = False  # restarted on its launch weights: needs the actor's before it serves again
        self._generating = 0
        self._restored = threading.Condition()
        self._awaiting = False

    def address(self) -> str:
        return self.engine.urls[0].removeprefix("http://")

    def max_sequence_length(self) -> int:
        """Prompt + response tokens the server holds (its context length)."""
        return self.engine.max_sequence_length

    def _on_restart(self, engine: int) -> None:
        """Runs after a restart. During a rollout the retried requests wait here until the driver has synced the
        current weights into the engine (weights_restored); otherwise the next rollout restores it first."""
        with self._restored:
            self.stale = True
            if not self._generating:
                return
            self._awaiting = True
            deadline = time.monotonic() + self.engine.cfg.request_timeout_s
            while self.stale and time.monotonic() < deadline:
                self._restored.wait(1.0)
            self._awaiting = False
            if self.stale:
                raise RuntimeError("a restarted engine waited for the actor's weights longer than "
                                   f"rollout.engine.request_timeout_s={self.engine.cfg.request_timeout_s}")

    def awaiting_weights(self) -> bool:
        return self._awaiting

    def is_stale(self) -> bool:
        return self.stale

    def stats(self) -> dict[str, int]:
        return dict(self.engine.stats)

    def weights_restored(self) -> None:
        with self._restored:
            self.stale = False
            self._restored.notify_all()

    def generate(self, prompts, sampling, max_new_tokens=None):
        with self._restored:
            self._generating += 1
        try:
            return self.engine.generate(prompts, sampling, max_new_tokens=max_new_tokens)
        finally:
            with self._restored:
                self._generating -= 1

    def recover(self) -> None:
        """Restarts the server if it is dead (a failed weight update's cause)."""
        self.engine.recover(0)

    def call(self, method: str, *args):
        return getattr(self.engine, method)(*args)


# Ray leaves CUDA_VISIBLE_DEVICES unset in its workers when this is 1: every rank of a node then sees all its GPUs and
# takes GPU 0
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def check_visible_devices_set(noset: list[str | None]) -> None:
    """Refuses a GPU run whose Ray workers (`noset`: each one's NOSET_VISIBLE_DEVICES) are not given their GPUs."""
    if any(v not in (None, "", "0") for v in noset):
        raise ConfigError(f"resources: the Ray workers have {NOSET_VISIBLE_DEVICES}=1, so Ray does not set "
                          "CUDA_VISIBLE_DEVICES and every rank of a node would use GPU 0; unset it where Ray starts")


def order_slots(found: list[tuple[str, str, str | None]]) -> list[int]:
    """Bundle indices sorted by (node IP, node id, GPU id) from each bundle's (node id, IP, GPU id): numeric parts
    of the IP and numeric GPU ids as numbers; a GPU id Ray gives as a UUID (GPU-...), as text after the numbers."""
    def key(b: int):
        node, ip, gpu = found[b]
        address = tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in ip.replace(":", ".").split("."))
        device = (0, int(gpu), "") if gpu is not None and gpu.isdigit() else (1, 0, gpu or "")
        return address, node, device, b

    return sorted(range(len(found)), key=key)


def check_private(host: str) -> None:
    """An engine that accepts LoRA adapters listens on loopback or a private network only."""
    import ipaddress

    address = ipaddress.ip_address(host)
    if not (address.is_loopback or address.is_private):
        raise ConfigError(f"actor.lora.allow_remote_engines: the engines would serve LoRA adapters on {host}, a "
                          "public address (SGLang's adapter-from-tensors endpoint has had a remote-code CVE, "
                          "CVE-2026-15969); use a private cluster network, or set it true to accept the risk")


def _resource_text(resources: dict) -> str:
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in ("GPU", "CPU"))


def check_cluster_holds(devices: int, bundle: dict, resources: dict) -> None:
    """Refuses at once a run the Ray cluster cannot hold (Ray would wait for resources that never come)."""
    for kind, per in bundle.items():
        if resources.get(kind, 0) < devices * per:
            raise ConfigError(f"resources: the run asks for {devices} devices ({devices * per:g} {kind}), the Ray "
                              f"cluster has {_resource_text(resources)}")


class Cluster:
    """The placement group and what runs on it."""

    def __init__(self, recipe: Recipe, plan: Plan, address: str | None = None):
        import ray
        from ray.util.placement_group import placement_group

        start_ray(address, plan)
        self.recipe, self.plan, self.gpu = recipe, plan, plan.device == "cuda"
        bundle = {"CPU": 1, **({"GPU": 1} if self.gpu else {})}
        check_cluster_holds(plan.devices, bundle, ray.cluster_resources())
        self.pg = placement_group([dict(bundle) for _ in range(plan.devices)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"resources: Ray placed none of the {plan.devices} bundles {bundle} within 600 s; "
                              f"the cluster has {_resource_text(ray.available_resources())} free") from None
        self.slots, self.slot_nodes, self.slot_ips, self.slot_gpus = self._order_bundles()
        check_groups_on_one_node(plan, self.slot_nodes, recipe.resources.devices_per_node)
        self.train_bundles = self.slots[:plan.actor_world]
        self.engines: list = []
        self.engines_served: list = []  # the servers of served models (teacher, judge)
        self._served: dict[str, list] = {}  # their addresses (or Ray references to them), by name
        self.groups: list[WorkerGroup] = []

    def _order_bundles(self) -> tuple[list[int], list[str], list[str], list[str | None]]:
        """Bundles sorted by (node IP, node, GPU id), as slime does: slot d -> bundle, Ray node id, node IP, GPU."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def where():
            ids = ray.get_gpu_ids()
            return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                    str(ids[0]) if ids else None, os.environ.get(NOSET_VISIBLE_DEVICES))

        probe = ray.remote(where)
        found = ray.get([probe.options(num_cpus=0, num_gpus=0.01 if self.gpu else 0,
                                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                                           placement_group=self.pg, placement_group_bundle_index=b)).remote()
                         for b in range(self.plan.devices)])
        if self.gpu:
            check_visible_devices_set([noset for *_, noset in found])
        order = order_slots([row[:3] for row in found])
        return order, *([found[b][i] for b in order] for i in range(3))

    def bundle_nodes(self) -> dict[int, str]:
        """The Ray node id of each device slot, as placed."""
        return dict(enumerate(self.slot_nodes))

    def worker_group(self, name: str, model: ModelConfig, parallel: ParallelConfig, value_head: bool = False,
                     recompute: str = "none", router: RouterConfig = RouterConfig(), lora: LoraConfig = LoraConfig()
                     ) -> WorkerGroup:
        group = WorkerGroup(name, self.pg, self.train_bundles, model, parallel, self.recipe.model.dtype,
                            self.recipe.trainer.seed, self.gpu, recompute, value_head, router,
                            Path(self.recipe.trainer.output_dir) / "logs", lora)
        self.groups.append(group)
        return group

    def launch_engines(self, model_path: str, log_dir: Path, routed_experts: bool = False,
                       random_weights: bool = False, lora_adapter: str = "") -> None:
        """Launches the SGLang engines from an HF checkpoint (or attaches to rollout.engine.addresses) without
        waiting for them (engine_addresses waits). Servers listen on 127.0.0.1 unless the run spans nodes.
        `routed_experts`: samples come with the experts their tokens were routed to (mixture-of-experts models).
        `random_weights`: `model_path` holds a config alone; the servers start with random weights, which the
        first sync replaces. `lora_adapter`: the engines serve this PEFT adapter (RolloutConfig.lora_adapter); they
        must then listen on loopback or a private network (SGLang's adapter endpoints have had a remote-code CVE)
        unless actor.lora.allow_remote_engines."""
        import ray

        cfg = dataclasses.replace(self.recipe.rollout.engine, model_path=model_path,
                                  return_routed_experts=routed_experts, random_weights=random_weights,
                                  lora_adapter=lora_adapter)
        # generate calls at once: one rollout (sync modes) or every group the staleness bound admits (async), and
        # the driver's control calls beside them
        r = self.recipe.rollout
        calls = 8 + ((r.staleness_bound + 1) * self.recipe.data.train_batch_size if r.mode == "async" else 0)
        remote = ray.remote(EngineWorker).options
        if cfg.addresses:
            self.engines = [remote(num_cpus=0, max_concurrency=calls).remote(
                dataclasses.replace(cfg, addresses=(address,), num_engines=1), str(log_dir / f"engine{e}"), None,
                cfg.host)
                for e, address in enumerate(cfg.addresses)]
            # the plan checked the context of the servers it launches; an attached one has its own
            longest = self.plan.max_sequence_tokens
            for address, tokens in zip(cfg.addresses, ray.get([e.max_sequence_length.remote() for e in self.engines])):
                if tokens < longest:
                    raise ConfigError(f"rollout.engine.addresses: the server at {address} holds {tokens} tokens a "
                                      f"sequence, fewer than data.max_prompt_length + data.max_response_length = "
                                      f"{longest}")
            self._addresses = [engine.address.remote() for engine in self.engines]
            return
        for e, (first, _) in enumerate(self.plan.engines):
            if lora_adapter and not self.recipe.actor.lora.allow_remote_engines:
                check_private(self._engine_host(first))
            engine_cfg = dataclasses.replace(cfg, base_port=cfg.base_port + e if cfg.base_port else 0)
            self.engines.append(self._engine_worker(engine_cfg, first, log_dir / f"engine{e}", self.plan.colocated,
                                                    calls))
        self._addresses = [engine.address.remote() for engine in self.engines]

    def _engine_host(self, first: int) -> str:
        """Where an engine whose first device slot is `first` listens: 127.0.0.1 unless the run spans nodes."""
        return self.slot_ips[first] if len(set(self.slot_nodes)) > 1 else "127.0.0.1"

    def _engine_worker(self, cfg: RolloutConfig, first: int, log_dir: Path, colocated: bool, calls: int):
        """An EngineWorker (one SGLang server of cfg.tp ranks) on device slots first, first + 1, ...: on their node,
        with their GPUs visible in TP rank order (rank i on slot first + i, the device of the trainer rank that
        feeds its payloads when colocated), on CPU their share of the node's cores."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        visible = ",".join(str(self.slot_gpus[s]) for s in range(first, first + cfg.tp)) if self.gpu else None
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=self.slots[first])
        per_node = self.recipe.resources.devices_per_node
        return ray.remote(EngineWorker).options(num_cpus=0.05, max_concurrency=calls,
                                                scheduling_strategy=strategy).remote(
            cfg, str(log_dir), visible, self._engine_host(first), colocated, first % per_node, per_node)

    def serve(self, name: str, model_path: str, cfg: RolloutConfig, log_dir: Path) -> None:
        """Launches the SGLang servers of a served model `name` (a teacher or a judge: `cfg`'s num_engines, engine e
        on the devices of rollout engine e modulo their number, whose cores or GPUs it shares; the plan checked
        that it has its memory share on GPU; listening as those engines do) without waiting for them
        (served_addresses waits), or attaches to cfg.addresses. Their weights never change: no weight sync, and a
        restarted one comes back as it was."""
        if cfg.addresses:
            self._served[name] = list(cfg.addresses)
            return
        # engine e on rollout engine e's first devices (round-robin), or from slot 0 with attached engines
        firsts = [self.plan.engines[e % len(self.plan.engines)][0] if self.plan.engines else 0
                  for e in range(cfg.num_engines)]
        workers = [self._engine_worker(dataclasses.replace(cfg, model_path=model_path, num_engines=1,
                                                           base_port=cfg.base_port + e if cfg.base_port else 0),
                                       first, log_dir / f"{name}{e}", False, 8) for e, first in enumerate(firsts)]
        self.engines_served += workers
        self._served[name] = [worker.address.remote() for worker in workers]

    def served_addresses(self, name: str) -> list[str]:
        """The addresses of served model `name`'s servers, once they serve."""
        import ray

        return [a if isinstance(a, str) else ray.get(a) for a in self._served[name]]

    def engine_addresses(self) -> list[str]:
        """The launched engines' addresses, once they serve."""
        import ray

        return ray.get(self._addresses)

    def engine_ranks(self) -> list[list[int]] | None:
        """Colocated: the trainer ranks on each engine's devices (rank r sits on slot r), in its TP rank order."""
        if self.recipe.rollout.placement != "colocated" or self.recipe.rollout.engine.addresses:
            return None
        return [list(range(first, first + n)) for first, n in self.plan.engines]

    def generate(self, prompts: list[list[int]], sampling, restore: Callable[[int], None],
                 sessions: list[int] | None = None, max_new_tokens: list[int] | None = None) -> list:
        """Prompts dealt to the engines by session (default: round-robin), so that a conversation's turns reach the
        engine that holds its prefix; samples in (prompt, sample) order. `max_new_tokens`: per prompt (RolloutEngine).
        `restore(e)` gives engine e the actor's current weights: called for an engine restarted since the last sync
        before it serves, and for one restarted during this rollout while its retried requests wait."""
        import ray

        for e, stale in enumerate(ray.get([engine.is_stale.remote() for engine in self.engines])):
            if stale:
                self._restore(e, restore)
        sessions = range(len(prompts)) if sessions is None else sessions
        shares = [[i for i, s in enumerate(sessions) if s % len(self.engines) == e] for e in range(len(self.engines))]
        calls = {engine.generate.remote([prompts[i] for i in share], sampling,
                                        None if max_new_tokens is None else [max_new_tokens[i] for i in share]): e
                 for e, (engine, share) in enumerate(zip(self.engines, shares)) if share}
        pending, answers = list(calls), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in done:
                answers[calls[ref]] = ray.get(ref)
            if pending:
                waiting = ray.get([self.engines[calls[ref]].awaiting_weights.remote() for ref in pending])
                for ref, awaiting in zip(pending, waiting):
                    if awaiting:
                        self._restore(calls[ref], restore)
        samples = []
        for e, answer in answers.items():
            for s in answer:
                s.prompt_index = shares[e][s.prompt_index]
                samples.append(s)
        samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return samples

    def _restore(self, engine: int, restore: Callable[[int], None]) -> None:
        log.warning("rollout engine %d was restarted: giving it the actor's current weights", engine)
        restore(engine)  # ends with engines_synced([engine]): its waiting requests go on

    def engines_call(self, method: str, *args) -> list:
        import ray

        return ray.get([engine.call.remote(method, *args) for engine in self.engines])

    def recover_engines(self, engines: list[int]) -> None:
        """Restarts those of `engines` whose server died (the caller syncs them next)."""
        import ray

        ray.get([self.engines[e].recover.remote() for e in engines])

    def engines_synced(self, engines: list[int] | None = None) -> None:
        """The engines (default: all) hold the current weights: none of them waits to be restored."""
        import ray

        ray.get([self.engines[e].weights_restored.remote() for e in engines or range(len(self.engines))])

    def engine_stats(self) -> dict[str, int]:
        """Restarts and retried requests over all engines (since launch)."""
        import ray

        total = {"engine_restarts": 0, "request_retries": 0}
        for stats in ray.get([engine.stats.remote() for engine in self.engines]):
            for k, v in stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def shutdown(self) -> None:
        """Stops the worker groups and the engines (their servers first), then every Ray actor of the run: a local
        Ray instance with them, a cluster's by ending this job."""
        import ray

        for group in self.groups:
            group.shutdown()
        for engine in self.engines + self.engines_served:
            try:
                ray.get(engine.call.remote("shutdown"), timeout=60)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            ray.kill(engine)
        self.engines, self.engines_served = [], []
        ray.shutdown()

