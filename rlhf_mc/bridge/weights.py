"""Moving weights between an HF checkpoint and this rank's Megatron model chunks.

load_hf_weights: each rank reads only the slices of its own shards.
ExportPlan + export_hf_weights: full HF tensors streamed from a sharded model, bucket by bucket (an expert broadcast
from the EP rank that holds it, then every tensor broadcast from the owning pipeline stage, gathered over TP,
converted to HF layout). The plan is computed once per model and holds no
tensors, so nothing in it can go stale between exports.
write_hf_weights: the same buckets written in place, for ranks that share memory: each rank copies its own shards
straight into the full HF tensors (no gather, no broadcast, one copy).
A model with LoRA adapters (models/lora.py) exports its effective weights: each adapted base weight with its
adapter's delta merged in, computed as the bucket reads it (no merged copy of the model is kept); the adapters
themselves are not HF weights (models/lora.full_tensors gives them as PEFT's).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from tqdm import tqdm

from rlhf_mc.bridge.hf_config import check_matches, read_hf_config
from rlhf_mc.bridge.mapping import (Rule, expert_index, fused_group, is_exported, read_shard, rule_for, shard_pieces,
                                    to_hf)
from rlhf_mc.bridge.safetensors_io import HFCheckpoint
from rlhf_mc.config import ModelConfig
from rlhf_mc.models import lora

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# A local expert's parameter: Megatron's SequentialMLP (local spec) and TE's grouped MLP name them differently.
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc(\d)\.weight"
                           r"|linear_fc(\d)\.weight(\d+))$")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP, Float16Module
        chunk = chunk.module
    return chunk


def weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a model's checkpoint holds and training changes: its parameters, and the MoE routers' expert biases
    (buffers, moved by the auxiliary-loss-free load balancing)."""
    biases = [(name, b) for name, b in module.named_buffers() if name.endswith(".router.expert_bias")]
    return [*module.named_parameters(), *biases]


def local_parameters(chunks) -> Iterator[tuple[int, str, str, torch.Tensor]]:
    """(chunk index, local name, global Megatron name, tensor) for this rank's parameters, and the routers' expert
    biases (buffers the checkpoint holds, moved by training's load balancing). Global names number layers over the
    pipeline and experts over EP (bridge/mapping.py)."""
    from megatron.core import parallel_state as ps

    for index, chunk in enumerate(chunks):
        gpt = _unwrap(chunk)
        experts = gpt.config.num_moe_experts
        first_expert = ps.get_expert_model_parallel_rank() * experts // ps.get_expert_model_parallel_world_size() \
            if experts else 0
        for name, param in weights(gpt):
            if lora.is_adapter_parameter(name):
                continue
            match = _LOCAL_LAYER.match(name)
            if match:  # local layer j -> global layer number (1-based in Megatron)
                layer = gpt.decoder.layers[int(match.group(1))].layer_number - 1
                suffix = name[match.end():]
                expert = _LOCAL_EXPERT.match(suffix)
                if expert:  # local expert j -> global expert
                    j, fc = (expert.group(1), expert.group(2)) if expert.group(1) else (expert.group(4),
                                                                                       expert.group(3))
                    suffix = f"mlp.experts.local_experts.{first_expert + int(j)}.linear_fc{fc}.weight"
                name_global = f"decoder.layers.{layer}.{suffix}"
            else:
                name_global = name
            yield index, name, name_global, param


def load_hf_weights(chunks, hf_dir, model: ModelConfig, progress: bool = False,
                    value_head_from: str | None = None) -> None:
    """Loads an HF checkpoint into this rank's chunks; refuses a config that differs from `model`. A value head
    loads the HF tensor `value_head_from` ("score.weight" of a sequence-classification reward model), or keeps its
    own initialization (a critic started from a causal LM)."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.gpt import ValueHead

    check_matches(model, read_hf_config(hf_dir))
    ckpt = HFCheckpoint(hf_dir)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    value_head = {id(p) for chunk in chunks for m in _unwrap(chunk).modules() if isinstance(m, ValueHead)
                  for p in m.parameters()}
    params = [entry for entry in local_parameters(chunks) if value_head_from or id(entry[3]) not in value_head]
    for _, _, name, param in tqdm(params, desc="load HF weights", disable=not progress):
        rule = Rule(name, (value_head_from,)) if id(param) in value_head else rule_for(name, model)
        shard = read_shard(rule, ckpt, model, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: HF tensors {list(rule.hf_names)} give a shard of shape {list(shard.shape)}, "
                             f"the model expects {list(param.shape)}")
        with torch.no_grad():
            param.copy_(shard)


class _Exported(Mapping):
    """(chunk index, local name) -> the tensor the bridge exports for that parameter: the parameter, or an adapted
    base weight with its LoRA delta added (computed at each read)."""

    def __init__(self, chunks):
        self.params = {(chunk, local_name): param for chunk, local_name, _, param in local_parameters(chunks)}
        self.adapted = lora.merged_weights(chunks)

    def __getitem__(self, key):
        param = self.params[key]
        adapter = self.adapted.get(key)
        return param.detach() if adapter is None or not adapter.enabled else param.detach() + adapter.delta_weight()

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    rule: Rule
    pp_rank: int  # owning pipeline stage
    ep_rank: int | None  # an expert's: the EP rank that holds it (None: every EP rank holds the parameter)
    chunk: int  # virtual stage index on the owner
    local_name: str
    shape: tuple[int, ...]  # full (TP-gathered) Megatron shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    entries: tuple[PlanEntry, ...]
    buckets: tuple[tuple[int, ...], ...]  # entry indices per bucket
    # per bucket, (HF name, shape, dtype) of its full HF tensors, in export_hf_weights' order
    hf_shapes: tuple[tuple[tuple[str, torch.Size, torch.dtype], ...], ...]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def largest_bucket_bytes(self) -> int:
        return max(sum(self.entries[i].nbytes for i in bucket) for bucket in self.buckets)


def build_export_plan(chunks, model: ModelConfig, bucket_bytes: int = 256 * 2**20, adapted_only: bool = False
                      ) -> ExportPlan:
    """Every exported parameter of the model with its owner, shape and dtype, grouped in buckets of at most
    `bucket_bytes` (a larger tensor gets a bucket of its own); `adapted_only`: only the base weights LoRA adapters
    change (a merged sync: the rest is the frozen base the engines hold). Collective over the pipeline group."""
    from megatron.core import parallel_state as ps

    tp, ep_rank = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    adapted = lora.merged_weights(chunks)
    local = []
    for chunk, local_name, name, param in local_parameters(chunks):
        rule = rule_for(name, model)
        if is_exported(rule, model) and (not adapted_only or (chunk, local_name) in adapted):
            shape = list(param.shape)
            if rule.tp_dim is not None:
                shape[rule.tp_dim] *= tp
            owner = ep_rank if expert_index(name) is not None else None
            local.append((rule, owner, chunk, local_name, tuple(shape), param.dtype))
    per_ep_rank = [None] * ps.get_expert_model_parallel_world_size()
    dist.all_gather_object(per_ep_rank, local, group=ps.get_expert_model_parallel_group())
    # The stage's parameters once: the shared ones from EP rank 0, each EP rank's own experts
    stage = [item for rank, items in enumerate(per_ep_rank) for item in items if item[1] == rank or rank == 0]
    per_stage = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(per_stage, stage, group=ps.get_pipeline_model_parallel_group())
    entries = tuple(PlanEntry(rule, pp_rank, *item) for pp_rank, items in enumerate(per_stage)
                    for rule, *item in items)
    # Entries SGLang must get in one call (mapping.fused_group) travel as one unit, in one bucket.
    units: list[list[int]] = []
    groups: dict[str, list[int]] = {}
    for i, entry in enumerate(entries):
        key = fused_group(entry.rule)
        if key in groups:
            groups[key].append(i)
            continue
        units.append([i])
        if key is not None:
            groups[key] = units[-1]
    buckets, current, size = [], [], 0
    for unit in units:
        nbytes = sum(entries[i].nbytes for i in unit)
        if current and size + nbytes > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.extend(unit)
        size += nbytes
    if current:
        buckets.append(tuple(current))
    hf_shapes = []
    for bucket in buckets:  # from meta tensors (HF shapes do not depend on the TP size)
        fulls = [(entries[i].rule, torch.empty(entries[i].shape, dtype=entries[i].dtype, device="meta"))
                 for i in bucket]
        hf_shapes.append(tuple((name, t.shape, t.dtype) for rule, full in fulls
                               for name, t in to_hf(rule, full, 1, model)))
    return ExportPlan(entries, tuple(buckets), tuple(hf_shapes))


def export_hf_weights(chunks, plan: ExportPlan, model: ModelConfig) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields, bucket by bucket, [(HF name, full tensor), ...] on every rank. Collective: every rank of the model's
    TP x PP groups must iterate it to the end. A yielded tensor may share memory with the model's parameter (an
    unsharded one on its owning stage): read it, don't keep it past the next optimizer step."""
    from megatron.core import parallel_state as ps

    pp_rank, pp_group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    tp, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    ep_rank, ep_group = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group()
    params = _Exported(chunks)
    device = next(iter(params.params.values())).device
    for bucket in plan.buckets:
        out = []
        for entry in (plan.entries[i] for i in bucket):
            tp_dim = entry.rule.tp_dim
            if entry.pp_rank == pp_rank and entry.ep_rank is not None:  # an expert: whole on one EP rank
                if entry.ep_rank == ep_rank:
                    full = params[(entry.chunk, entry.local_name)]
                else:
                    full = torch.empty(entry.shape, dtype=entry.dtype, device=device)
                if dist.get_world_size(ep_group) > 1:
                    dist.broadcast(full, src=dist.get_global_rank(ep_group, entry.ep_rank), group=ep_group)
            elif entry.pp_rank == pp_rank:
                local = params[(entry.chunk, entry.local_name)]
                if tp_dim is not None and tp > 1:  # the shards in rank order along dim 0: the full tensor if tp_dim 0
                    gathered = torch.empty((tp * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=device)
                    dist.all_gather_into_tensor(gathered, local.contiguous(), group=tp_group)
                    full = gathered if tp_dim == 0 else torch.cat(gathered.chunk(tp), dim=tp_dim)
                else:
                    full = local  # no copy: see the docstring
            else:
                full = torch.empty(entry.shape, dtype=entry.dtype, device=device)
            if dist.get_world_size(pp_group) > 1:
                dist.broadcast(full, src=dist.get_global_rank(pp_group, entry.pp_rank), group=pp_group)
            out.extend(to_hf(entry.rule, full, tp if tp_dim is not None else 1, model))
        yield out



def write_hf_weights(chunks, plan: ExportPlan, model: ModelConfig,
                     out: Callable[[int], dict[str, torch.Tensor]]) -> Iterator[int]:
    """Writes, bucket by bucket, this rank's share of bucket b into out(b) (HF name -> full HF tensor, in memory every
    rank of the model writes to) and yields b: a TP rank its slice of each split parameter, the EP rank holding an
    expert that expert, one replica every other parameter (data-parallel rank 0; TP rank 0 where it is not split).
    Not collective: the caller waits for every rank before reading a bucket, and before its memory takes another."""
    from megatron.core import parallel_state as ps

    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    first_replica = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    first_expert_replica = ps.get_expert_data_parallel_rank() == 0
    params = _Exported(chunks)
    for b, bucket in enumerate(plan.buckets):
        targets = out(b)
        for entry in (plan.entries[i] for i in bucket):
            split = entry.rule.tp_dim is not None and entry.ep_rank is None and tp > 1
            if entry.pp_rank != pp_rank or not (
                    entry.ep_rank == ep_rank and first_expert_replica if entry.ep_rank is not None
                    else first_replica and (split or tp_rank == 0)):
                continue
            shard = params[(entry.chunk, entry.local_name)]
            for name, piece in shard_pieces(entry.rule, shard, model):
                target = targets[name]
                if split:  # this rank's slice along tp_dim (dim 0 for the fused layouts)
                    step = target.shape[entry.rule.tp_dim] // tp
                    target = target.narrow(entry.rule.tp_dim, tp_rank * step, step)
                target.view(piece.shape).copy_(piece)
        yield b
