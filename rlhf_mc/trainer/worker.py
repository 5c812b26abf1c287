"""One rank of a Megatron model group (actor, critic, reference or reward model), run as a Ray actor. The driver
hands each rank its data-parallel share (trainer/placement.py); the reporting rank of each data-parallel group
(first TP and CP rank of the last pipeline stage) returns the results, in the share's order."""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import sys
from pathlib import Path

import torch

from rlhf_mc.config import LoraConfig, ModelConfig, OptimizerConfig, ParallelConfig, RouterConfig
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.runtime import console, host, ray_tensors


def node_ip() -> str:
    """This node's IP as Ray sees it (outside Ray: the host name's)."""
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return socket.gethostbyname(socket.gethostname())


class ModelWorker:
    """Created on every rank, then `start`ed with rank 0's `store_address()`: rank 0 binds the rendezvous store on a
    port the system picks, so no other process can take the port between its choice and its use (a free port chosen
    ahead and bound later can be: any outgoing connection may get it as its local port)."""

    def __init__(self, rank: int, world: int, model: ModelConfig, parallel: ParallelConfig, dtype: str, seed: int,
                 recompute: str = "none", value_head: bool = False, router: RouterConfig = RouterConfig(),
                 log_file: str | None = None, lora: LoraConfig = LoraConfig()):
        """`log_file`: where this rank's output goes (else Ray's worker log). `lora`: adapters on the model
        (models/lora.py): the base frozen, the reference is the base with the adapters off."""
        if log_file:
            console.output_to(log_file)
        console.quiet_framework_warnings()
        # megatron.core.timers imports wandb, where installed, for a writer the ranks are never given: 1.3 s of every
        # rank's start on 2 cores. The driver is the process that logs to wandb.
        sys.modules.setdefault("wandb", None)
        ray_tensors.register()
        self.rank, self.world, self.model, self.lora = rank, world, model, lora
        self._build = (parallel, dtype, seed, recompute, value_head, router)
        self.replay_routing = router.replay  # the policy's forward passes replay the engine's routing (MoE)
        self._store = None
        if rank == 0:
            self._store = torch.distributed.TCPStore(node_ip(), 0, world, is_master=True, wait_for_workers=False,
                                                     timeout=datetime.timedelta(minutes=30))
        self.state = None  # TrainState once an optimizer is set up
        self.reference = None  # HostReference of the actor
        self.weight_sync = None
        # runtime.offload.Offloaded per part ("all", "weights", "optimizer"): what is in host memory now, and the
        # host buffers kept for the next offload of that part
        self.host_copy: dict[str, list] = {}
        self.offloaded: list[str] = []

    def store_address(self) -> tuple[str, int]:
        return node_ip(), self._store.port

    def start(self, master: tuple[str, int]) -> dict:
        """Joins the group's process group and builds this rank's model chunks; returns the rank's layout
        (placement.RankLayout's fields)."""
        from megatron.core import parallel_state as ps

        from rlhf_mc.models.gpt import build_model
        from rlhf_mc.runtime import init_distributed, init_parallel

        parallel, dtype, seed, recompute, value_head, router = self._build
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0", MASTER_ADDR=master[0],
                          MASTER_PORT=str(master[1]))
        if not torch.cuda.is_available():
            host.use_host(self.world)
        if self._store is None:  # every rank through a store object: the keys then share one namespace
            self._store = torch.distributed.TCPStore(master[0], master[1], self.world, is_master=False,
                                                     timeout=datetime.timedelta(minutes=30))
        init_distributed(store=self._store)
        init_parallel(parallel, seed=seed)
        self.chunks = build_model(self.model, parallel, dtype=dtype, recompute=recompute, value_head=value_head,
                                  router=router)
        if self.lora.enabled:
            from rlhf_mc.models import lora
            from rlhf_mc.models.gpt import te_available

            lora.check_lora(self.lora, self.model, te_available())
            lora.attach(self.chunks, self.model, self.lora, seed)
        return {"dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
                "reports": self._reports()}

    # ------------------------------------------------------------ weights, optimizer, checkpoints

    def load_hf(self, path: str, value_head_from: str | None = None) -> None:
        from rlhf_mc.bridge.weights import load_hf_weights

        load_hf_weights(self.chunks, path, self.model, value_head_from=value_head_from)

    def load_adapter(self, path: str) -> None:
        """A PEFT adapter directory into the adapters (checked against the model: bridge/adapters.py)."""
        from rlhf_mc.bridge.adapters import read_peft_adapter
        from rlhf_mc.models.lora import load_full

        load_full(self.chunks, read_peft_adapter(path, self.lora, self.model))

    def setup_optimizer(self, optim: OptimizerConfig) -> None:
        from rlhf_mc.optim import setup_training

        self.state = setup_training(self.chunks, optim)

    def keep_reference(self) -> None:
        """The current weights become the frozen reference (host memory)."""
        from rlhf_mc.workers.policy import HostReference

        self.reference = HostReference(self.chunks)

    def save(self, path: str, trainer_state: dict | None = None) -> None:
        """Model + optimizer + lr schedule + this rank's RNG, atomically; `trainer_state` goes to trainer_state.json."""
        from rlhf_mc.bridge.convert import write_metadata
        from rlhf_mc.models.checkpoint import save_model

        rng_states = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rng_states, {"torch": torch.get_rng_state(), "python": random.getstate()})

        def add_files(tmp: Path) -> None:
            extra = {"scheduler": self.state.scheduler.state_dict()} if self.state else {}
            (tmp / "trainer_state.json").write_text(json.dumps({**(trainer_state or {}), **extra}, indent=1))
            torch.save(rng_states, tmp / "rng.pt")
            parallel, dtype = self._build[:2]
            write_metadata(tmp, self.model, dtype, parallel)  # tools/score.py and mcore-to-hf read the checkpoint

        save_model(self.chunks, path, add_files, optimizer=self.state.optimizer if self.state else None)

    def load(self, path: str) -> dict:
        """Restores what save() wrote; returns the trainer state."""
        from rlhf_mc.models.checkpoint import load_model

        load_model(self.chunks, path, optimizer=self.state.optimizer if self.state else None)
        trainer_state = json.loads((Path(path) / "trainer_state.json").read_text())
        if self.state is not None:
            self.state.scheduler.load_state_dict(trainer_state.pop("scheduler"))
        rng = torch.load(Path(path) / "rng.pt", weights_only=False)[torch.distributed.get_rank()]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        return trainer_state

    def export_hf(self, path: str, config: dict, tokenizer_dir: str | None) -> None:
        """The model as an HF checkpoint (safetensors, `config` as config.json, the tokenizer files), written to a
        temp dir and renamed."""
        from rlhf_mc.bridge.convert import write_hf_export

        write_hf_export(self.chunks, self.model, path, config, Path(tokenizer_dir) if tokenizer_dir else None)

    def export_adapter(self, path: str, base_model: str) -> None:
        """The adapters as a PEFT directory (rank 0 writes it; collective)."""
        from rlhf_mc.bridge.adapters import write_peft_adapter
        from rlhf_mc.models.lora import full_tensors

        tensors = full_tensors(self.chunks)
        if torch.distributed.get_rank() == 0:
            write_peft_adapter(path, tensors, self.lora, base_model)

    def offload(self, part: str = "all") -> None:
        """Moves `part` of the training state to host memory (runtime.offload.offload_training_state): "all",
        "optimizer" (gradients and optimizer state) or "weights"."""
        from rlhf_mc.runtime.offload import offload_training_state

        self.host_copy[part] = offload_training_state(self.chunks, self.state.optimizer if self.state else None, part,
                                                      reuse=self.host_copy.get(part, []))
        self.offloaded.append(part)

    def reload(self, part: str | None = None) -> None:
        """Brings back `part` (default: everything offloaded)."""
        from rlhf_mc.runtime.offload import reload

        for p in [part] if part else self.offloaded[::-1]:
            reload(self.host_copy[p])
            self.offloaded.remove(p)

    # ------------------------------------------------------------ forward and updates on this rank's share

    def forward(self, share: Trajectories, kind: str, temperature: float = 1.0, with_entropy: bool = False,
                micro_batch_tokens: int = 8192) -> dict[str, torch.Tensor] | None:
        """kind: "logprobs" (the model's), "ref_logprobs" (the host reference swapped in; with LoRA, the
        adapters off) or "values", per token of this rank's share."""
        from rlhf_mc.models.lora import adapters_off
        from rlhf_mc.workers.policy import compute_log_prob, compute_values

        if kind == "values":
            out = compute_values(self.chunks, share, micro_batch_tokens)
        elif kind == "ref_logprobs":
            with adapters_off(self.chunks) if self.lora.enabled else self.reference.swapped_in(self.chunks):
                out = compute_log_prob(self.chunks, share, temperature, with_entropy, micro_batch_tokens,
                                       self.replay_routing)
        else:
            out = compute_log_prob(self.chunks, share, temperature, with_entropy, micro_batch_tokens,
                                   self.replay_routing)
        return out if self._reports() else None

    def _reports(self) -> bool:
        from megatron.core import parallel_state as ps

        return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                and ps.is_pipeline_last_stage(ignore_virtual=True))

    def update(self, mini_batches: list[Trajectories], kind: str, epochs: int = 1, loss_cfg=None,
               temperature: float = 1.0, micro_batch_tokens: int = 8192, value_clip: float = 0.2) -> dict:
        """kind: "actor" (policy loss), "critic" (value loss) or "sft". One optimizer step per mini-batch (this
        rank's share of it), `epochs` times; returns the metrics averaged over the optimizer steps."""
        from rlhf_mc.workers.train import critic_train_step, sft_step, train_step

        totals: dict[str, float] = {}
        for _ in range(epochs):
            for mb in mini_batches:
                if kind == "actor":
                    metrics = train_step(self.state, mb, loss_cfg, temperature, micro_batch_tokens,
                                         self.replay_routing)
                elif kind == "critic":
                    metrics = critic_train_step(self.state, mb, value_clip, loss_cfg.aggregation, micro_batch_tokens,
                                                loss_cfg.norm_length)
                else:
                    metrics = sft_step(self.state, mb, micro_batch_tokens)
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
        steps = len(mini_batches) * epochs
        return {k: v / steps for k, v in totals.items()}

    # ------------------------------------------------------------ weight sync

    def prepare_sync(self) -> None:
        """Imports what every sync into SGLang uses (its serializer, sglang.srt.utils: ~2.5 s on 2 cores), before the
        engines are ready: in connect_engines, once they are, it held up every launch by that much (measured)."""
        import sglang.srt.utils  # noqa: F401

    def connect_engines(self, addresses: list[str], transport: str, bucket_bytes: int,
                        engine_ranks: list[list[int]] | None, config_from: str, staging_dir: str) -> None:
        """The weight sync to the engines at `addresses` (sync/transports.py; collective over the group);
        `staging_dir`: the disk transport's (the run folder's)."""
        from rlhf_mc.sync.transports import connect
        from rlhf_mc.sync.weights import WeightSync

        master = node_ip() if transport == "distributed" else "127.0.0.1"
        # LoRA: the adapter ("adapter"), or the adapted layers alone, merged (the rest is the frozen base the
        # engines hold)
        sink = connect(transport, addresses, engine_ranks, master, config_from, self.lora, staging_dir)
        self.weight_sync = WeightSync(self.chunks, self.model, sink, bucket_bytes, adapted_only=self.lora.enabled)

    def exit(self) -> None:
        """Ends this worker: removes the shared-memory files it made (the weight sync's CPU staging), which a kill
        leaves behind, and exits. The staging is never released: releasing it after its file is gone aborts in torch
        (rollout.sglang_engine.unlink_staging), as Ray's graceful actor exit did, with a core dump in the console."""
        import ctypes

        import ray

        if self.weight_sync is not None:
            staging = self.weight_sync.transport.unlink_staging()
            if staging is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(staging))  # held past the interpreter's end
        ray.actor.exit_actor()

    def reconnect_engines(self) -> None:
        """After engines were restarted: a broadcast transport forms its group with them again."""
        reconnect = getattr(self.weight_sync.transport, "reconnect", None)
        if reconnect is not None:
            reconnect()

    def sync(self, version: int, engines: list[int] | None = None):
        """sync.weights.SyncStats of this rank."""
        return self.weight_sync.sync(self.chunks, version, engines)
