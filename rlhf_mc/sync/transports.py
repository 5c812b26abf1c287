"""How the actor's new weights reach the rollout engines: one class per transport. Each is built collectively on
every actor rank and sends the export plan's buckets of full HF-named tensors, collectively: from the stream of
bridge.weights.export_hf_weights (which every rank iterates to the end: the stream itself runs collectives; a
transport drains what it does not send), or written in place by every rank (SharedStaging).

- SharedStaging ("tensor" on CPU, every actor rank on one host): one shared-memory staging buffer of two of the
  plan's largest buckets, made once by rank 0 and mapped by every rank; each rank writes its own shards of a bucket
  straight into one half in SGLang's flattened-bucket layout (bridge.weights.write_hf_weights: no TP gather, no
  pipeline or expert broadcast, one copy of each tensor, split over the ranks that hold it), and rank 0 posts it to
  every engine TP rank, which loads it while the ranks write the next bucket into the other half. The same bucket
  through ColocatedTensors costs a gloo gather, the HF layout copies and the staging copy.
- ColocatedTensors ("tensor"): engine e's TP rank i gets its payload from the trainer rank on its own device, as
  SGLang's own sender and slime do. Per engine a gloo group of its trainer ranks; each serializes the bucket as a
  flattened tensor (rollout.sglang_engine.tensor_payload) and the group gathers the payloads to its first rank,
  which posts them to its engine (one payload per TP rank). Every engine is driven from its own node, so this
  works across nodes as long as each engine lies on one node (the plan checks that).
- Broadcast ("distributed", disaggregated placement): global rank 0 broadcasts each flattened bucket over a gloo /
  NCCL group it forms with every engine rank.
- Disk ("disk", fallback and debugging): rank 0 writes an HF checkpoint and every engine reloads it.
- AdapterTensors ("adapter", LoRA): the adapters alone, gathered to rank 0 as PEFT tensors and loaded into every
  engine's LoRA serving, replacing the last sync's; the base weights the engines started with stay.

`send` returns, on each rank that drove engines, the engines it updated and the ones that failed (with the error):
a failure never leaves the other ranks waiting in a collective, and the caller restarts and re-syncs those engines.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from rlhf_mc.bridge.adapters import peft_config
from rlhf_mc.bridge.weights import ExportPlan, export_hf_weights, write_hf_weights
from rlhf_mc.config import LoraConfig, ModelConfig, RolloutConfig
from rlhf_mc.models import lora
from rlhf_mc.rollout import cpu
from rlhf_mc.rollout.sglang_engine import (SGLangEngine, flat_layout, flat_views, serialize_flat, shared_staging,
                                           tensor_payload, unlink_staging)

Buckets = Iterator[list[tuple[str, torch.Tensor]]]


@dataclasses.dataclass
class SendResult:
    updated: list[int]  # engines this rank updated
    failed: dict[int, str]  # engine -> error


def _drain(buckets: Buckets) -> None:
    for _ in buckets:  # take part in the stream's broadcasts and gathers
        pass


def _client(addresses: list[str]) -> SGLangEngine:
    return SGLangEngine(RolloutConfig(addresses=tuple(addresses), num_engines=len(addresses)))


class SharedStaging:
    def __init__(self, addresses: list[str]):
        self.client = _client(addresses) if dist.get_rank() == 0 else None
        self.staging: torch.Tensor | None = None
        import sglang.srt.utils  # noqa: F401 - ~2.5 s of imports on CPU, paid here rather than in the first sync

    def send(self, chunks, plan: ExportPlan, model: ModelConfig, version: int, engines: Iterable[int] | None = None
             ) -> SendResult | None:
        """Rank 0 drives `engines` (default: all); an engine that fails is left out of the rest of the sync."""
        # Two halves: the ranks write bucket b + 1 into one while the engines load bucket b from the other, so the
        # engine's copy runs beside the ranks' instead of after them (bench/weight_sync.py --tp 1, 476 MB: 0.178 ->
        # 0.141 s in 64 MB buckets, 0.110 -> 0.103 s in 256 MB ones). A half starts on a page.
        half = -(-plan.largest_bucket_bytes // 4096) * 4096
        self._share(2 * half)
        targets = sorted(range(len(self.client.urls)) if engines is None else engines) if self.client else []
        failed: dict[int, str] = {}
        # Each call goes to every engine at once: one after another, two CPU engines' syncs took 0.047-0.065 s, at
        # once 0.041 s (one engine's: ~0.03 s; five HTTP calls an engine).
        fan_out = concurrent.futures.ThreadPoolExecutor(max(1, len(targets)), thread_name_prefix="weight-sync-engine")

        def each(call) -> None:
            def one(e: int) -> None:
                try:
                    call(e)
                except Exception as error:  # noqa: BLE001 - reported to the driver, which restarts the engine
                    failed[e] = f"engine {e} at {self.client.urls[e]}: {type(error).__name__}: {error}"

            list(fan_out.map(one, [e for e in targets if e not in failed]))

        layouts = [flat_layout(shapes) for shapes in plan.hf_shapes]  # (metadata, bytes) per bucket
        # Rank 0's calls to the engines, in order, beside the writes: the engines pause while the first bucket is
        # written (nothing reads the staging between loads), and load bucket b while the ranks write b + 1.
        calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-sync")
        posted: list[concurrent.futures.Future] = []  # rank 0's load of each bucket
        if self.client:
            calls.submit(each, lambda e: (self.client.pause([e]), self.client.begin_weight_update(e)))

        def staged(b: int) -> torch.Tensor:
            return self.staging[b % 2 * half:][:layouts[b][1]]

        def free_half(b: int) -> dict[str, torch.Tensor]:
            if b >= 2 and posted:
                posted[b - 2].result()
            dist.barrier()  # the engines are done with the half bucket b goes to
            return flat_views(staged(b), layouts[b][0])

        def load(b: int) -> None:
            # One serialization per receiving rank: each takes back the reference count its serialization added.
            each(lambda e: self.client.load_tensor_payloads(
                e, [serialize_flat(staged(b), layouts[b][0], staging=True) for _ in range(self.client.engine_tp[e])],
                version, last=b == len(layouts) - 1))

        # One thread: the copies are memory-bound, and with the cores' worth of threads each of the many copies of a
        # layer bucket waited for cores the engine's threads still held (OpenMP spins after its work): 10x slower at
        # TP=1 (measured: ~100 ms against ~11 ms a 60 MB bucket).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for b in write_hf_weights(chunks, plan, model, free_half):
                dist.barrier()  # every rank's share is in
                if self.client:
                    posted.append(calls.submit(load, b))
            for done in posted:
                done.result()
            each(lambda e: (self.client.end_weight_update(e, version), self.client.resume([e])))
        finally:
            calls.shutdown()
            fan_out.shutdown()
            torch.set_num_threads(threads)
        if self.client is None:
            return None
        return SendResult([e for e in targets if e not in failed], failed)

    def unlink_staging(self) -> torch.Tensor | None:
        """At the end of the run: removes the staging's shared-memory file (rank 0 made it); returns the staging,
        which the caller must never release (rollout.sglang_engine.unlink_staging)."""
        if self.staging is not None and dist.get_rank() == 0:
            unlink_staging(self.staging)
        return self.staging

    def _share(self, nbytes: int) -> None:
        """Makes the staging (rank 0) and maps it on every rank, once per size (collective)."""
        if self.staging is not None and self.staging.numel() >= nbytes:
            return
        from sglang.srt.utils import MultiprocessingSerializer

        self.staging = None  # the old one goes before the new one comes
        rank, world = dist.get_rank(), dist.get_world_size()
        staging = shared_staging(nbytes) if rank == 0 else None
        # One serialization per receiving rank, as for the engines.
        box = [[MultiprocessingSerializer.serialize(staging) for _ in range(world - 1)] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.staging = staging if rank == 0 else MultiprocessingSerializer.deserialize(box[0][rank - 1])


class ColocatedTensors:
    def __init__(self, addresses: list[str], engine_ranks: list[list[int]]):
        """`engine_ranks[e]`: the global trainer ranks on engine e's devices, in its TP rank order."""
        rank = dist.get_rank()
        self.engine_ranks = engine_ranks
        self.group = self.engine = self.client = None
        for e, ranks in enumerate(engine_ranks):
            group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(minutes=30))  # on every rank
            if rank in ranks:
                self.group, self.engine = group, e
        self.leader = self.engine is not None and rank == engine_ranks[self.engine][0]
        self.staging = None  # on CPU: one shared-memory buffer for every bucket (shared_staging says why)
        if self.engine is not None:
            import sglang.srt.utils  # noqa: F401 - ~2.5 s of imports on CPU, paid here rather than in the first sync
        if self.leader:
            self.client = _client([addresses[self.engine]])
            if self.client.engine_tp[0] != len(engine_ranks[self.engine]):
                raise ValueError(f"engine {self.engine} at {addresses[self.engine]} has TP "
                                 f"{self.client.engine_tp[0]}, placed on {len(engine_ranks[self.engine])} devices")

    def send(self, chunks, plan: ExportPlan, model: ModelConfig, version: int, engines: Iterable[int] | None = None
             ) -> SendResult | None:
        buckets = export_hf_weights(chunks, plan, model)
        if self.group is None or (engines is not None and self.engine not in set(engines)):
            _drain(buckets)
            return None
        error = self._call(lambda: (self.client.pause(), self.client.begin_weight_update(0)))
        members = self.engine_ranks[self.engine]
        for b, bucket in enumerate(buckets):
            payload = tensor_payload(bucket, self._staging(bucket))
            gathered = [None] * len(members) if self.leader else None
            dist.gather_object(payload.serialized, gathered, dst=members[0], group=self.group)
            if error is None:
                error = self._call(lambda: self.client.load_tensor_payloads(0, gathered, version,
                                                                            last=b == len(plan.buckets) - 1))
            dist.barrier(group=self.group)  # every payload stays alive until its engine has loaded it
            del payload
        if error is None:
            error = self._call(lambda: (self.client.end_weight_update(0, version), self.client.resume()))
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # the engine has closed its handles: free what they kept alive
        if not self.leader:
            return None
        return SendResult([] if error else [self.engine], {self.engine: error} if error else {})

    def unlink_staging(self) -> torch.Tensor | None:
        """At the end of the run: removes the CPU staging's shared-memory file; returns the staging, which the
        caller must never release (rollout.sglang_engine.unlink_staging)."""
        if self.staging is not None:
            unlink_staging(self.staging)
        return self.staging

    def _staging(self, bucket) -> torch.Tensor | None:
        if not cpu.on_cpu():
            return None  # CUDA's caching allocator already reuses the memory of the last bucket
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if self.staging is None or self.staging.numel() < nbytes:
            self.staging = None  # the old one goes before the new one comes
            self.staging = shared_staging(nbytes)
        return self.staging

    def _call(self, fn) -> str | None:
        """Runs an engine call on the leader; its failure as text (the stream must go on: others wait in it)."""
        if not self.leader:
            return None
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported to the driver, which restarts the engine
            return f"engine {self.engine} at {self.client.urls[0]}: {type(e).__name__}: {e}"
        return None


class _FromRankZero:
    """Transports where global rank 0 drives every engine."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.client = _client(addresses) if dist.get_rank() == 0 else None

    def send(self, chunks, plan: ExportPlan, model: ModelConfig, version: int, engines: Iterable[int] | None = None
             ) -> SendResult | None:
        """`engines` is ignored: these transports update every engine at once."""
        buckets = export_hf_weights(chunks, plan, model)
        if self.client is None:
            _drain(buckets)
            return None
        everyone = list(range(len(self.addresses)))
        try:
            self.client.pause()
            self._send(buckets, len(plan.buckets), version)
            self.client.resume()
        except Exception as e:  # noqa: BLE001 - reported to the driver, which restarts the engines
            _drain(buckets)
            return SendResult([], {engine: f"engines at {self.addresses}: {type(e).__name__}: {e}"
                                   for engine in everyone})
        return SendResult(everyone, {})

    def _send(self, buckets: Buckets, num_buckets: int, version: int) -> None:
        raise NotImplementedError

    def unlink_staging(self) -> None:
        """Nothing to remove: these transports keep no shared memory."""


class Broadcast(_FromRankZero):
    def __init__(self, addresses: list[str], master_address: str):
        super().__init__(addresses)
        self.master_address = master_address
        self.groups_formed = 0
        self.reconnect()

    def reconnect(self) -> None:
        """(Re)forms the weight group with every engine rank: at start, and after an engine was restarted (the old
        group is left on both sides first, or was aborted by the failed broadcast that restarted the engines)."""
        from rlhf_mc.runtime.spawn import free_port

        if self.client is not None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            self.groups_formed += 1  # a new name: engines that kept the old group must not mix the two up
            self.client.connect_weight_group(self.master_address, free_port(), backend=backend,
                                             group_name=f"rlhf_mc_weights_{self.groups_formed}")

    def _send(self, buckets: Buckets, num_buckets: int, version: int) -> None:
        self.client.update_weights_from_distributed(buckets, version, num_buckets)


class Disk(_FromRankZero):
    def __init__(self, addresses: list[str], config_from: str, staging_dir: str | None = None):
        """`config_from`: an HF checkpoint dir whose config.json (and generation_config.json) go with the
        weights. `staging_dir`: where each sync's checkpoint is written for the engines to read, a folder they
        see too (the run folder's, on a cluster's shared filesystem; default: this machine's temp dir)."""
        super().__init__(addresses)
        self.config_from = Path(config_from)
        self.staging_dir = staging_dir
        if staging_dir is not None:
            Path(staging_dir).mkdir(parents=True, exist_ok=True)

    def _send(self, buckets: Buckets, num_buckets: int, version: int) -> None:
        from rlhf_mc.bridge.safetensors_io import write_hf_checkpoint

        with tempfile.TemporaryDirectory(prefix="rlhf_mc_sync_", dir=self.staging_dir) as tmp:
            write_hf_checkpoint((pair for bucket in buckets for pair in bucket), Path(tmp))
            for name in ("config.json", "generation_config.json"):
                if (self.config_from / name).is_file():
                    shutil.copy2(self.config_from / name, Path(tmp) / name)
            self.client.update_weights_from_disk(tmp, version)


class AdapterTensors:
    def __init__(self, addresses: list[str], adapter: LoraConfig, base_model: str):
        self.client = _client(addresses) if dist.get_rank() == 0 else None
        self.adapter, self.config = adapter, peft_config(adapter, base_model)
        # The last payload's tensors, kept until the next load replaces them: the engine keeps some of the adapter's
        # tensors as it received them (sglang/srt/lora/lora.py stores loaded_weight.cpu(): on CPU the sender's shared
        # memory itself) and copies them into its pool only at their first use.
        self.sent: dict[str, torch.Tensor] | None = None

    def send(self, chunks, plan: ExportPlan | None, model: ModelConfig, version: int,
             engines: Iterable[int] | None = None) -> SendResult | None:
        """Rank 0 drives `engines` (default: all); an engine that fails is reported, the others are updated."""
        from sglang.srt.utils import MultiprocessingSerializer

        tensors = lora.full_tensors(chunks)  # collective; copies, never a parameter's memory
        if self.client is None:
            return None
        if cpu.on_cpu():
            cpu.prepare_tensor_sender()
        serialized = MultiprocessingSerializer.serialize(tensors, output_str=True)
        updated, failed = [], {}
        for e in sorted(range(len(self.client.urls)) if engines is None else engines):
            try:
                self.client.pause([e])
                self.client.load_adapter(e, self.config, [serialized] * self.client.engine_tp[e], version)
                self.client.resume([e])
                updated.append(e)
            except Exception as error:  # noqa: BLE001 - reported to the driver, which restarts the engine
                failed[e] = f"engine {e} at {self.client.urls[e]}: {type(error).__name__}: {error}"
        self.sent = tensors
        return SendResult(updated, failed)

    def unlink_staging(self) -> None:
        """Nothing to remove: torch's shared-memory manager frees the payloads' files."""


def connect(kind: str, addresses: list[str], engine_ranks: list[list[int]] | None = None,
            master_address: str = "127.0.0.1", config_from: str | None = None, adapter: LoraConfig | None = None,
            staging_dir: str | None = None):
    """The transport `kind` ("tensor" | "distributed" | "disk" | "adapter") to the engines at `addresses`;
    collective over the actor's ranks. "tensor" needs `engine_ranks` (colocated placement), "disk" and "adapter"
    `config_from` (the base model's HF checkpoint), "adapter" the actor's LoRA `adapter`; "disk" writes under
    `staging_dir` (Disk). On CPU with every actor rank on one host, "tensor" is SharedStaging."""
    if kind == "adapter":
        return AdapterTensors(addresses, adapter, config_from)
    if kind == "tensor":
        if engine_ranks is None:
            raise ValueError("the tensor transport needs engine_ranks: which trainer ranks share each engine's devices")
        if cpu.on_cpu():
            hosts = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            if len(set(hosts)) == 1:
                return SharedStaging(addresses)
        return ColocatedTensors(addresses, engine_ranks)
    if kind == "distributed":
        return Broadcast(addresses, master_address)
    if kind == "disk":
        if config_from is None:
            raise ValueError("the disk transport needs config_from: the HF checkpoint whose config goes along")
        return Disk(addresses, config_from, staging_dir)
    raise ValueError(f"rollout.sync_transport: unknown transport {kind!r}")
