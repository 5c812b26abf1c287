"""LoRA adapters on Megatron-Core's linear layers, PEFT's LoRA: y = W x + (alpha / r) B A dropout(x).

An adapter is what PEFT holds for the HF model: one A [r, in] and one B [out, r] per HF linear module (q_proj,
k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), so that adapters go to and from PEFT unchanged. Megatron
fuses some of those modules in one linear layer, and TP splits the layers; each adapter is split the way its base
weight is:
- column-parallel layers (linear_qkv = q, k, v per query group; linear_fc1 = [gate_r; up_r]): A replicated over
  TP, B split on its output dim as the base weight's rows are. The low-rank activation u = A x passes
  copy_to_tensor_model_parallel_region, whose backward all-reduces dL/du over TP: A's gradient is whole on every
  rank, as a replicated parameter's must be.
- row-parallel layers (linear_proj = o_proj, linear_fc2 = down_proj): A split on its input dim, B replicated; u is
  all-reduced over TP (reduce_from_tensor_model_parallel_region) before B.
The parts of a fused layer go through one matmul each way: u = x [A_q; A_k; A_v]^T, then u times a block matrix
that places each part's B at its rows of the fused layer.

A layer's adapters live in `layer.lora` (one LinearAdapter per Megatron linear), added to the linear's output by a
forward hook; every base parameter is frozen, so Megatron's DDP leaves it out of its buckets and the optimizer out
of its groups. `adapters_off` gives the base model (the reference, with no second copy in memory). Sharded
checkpoints carry the adapters with their TP split (LinearAdapter.sharded_state_dict).
Local layer spec only: Transformer Engine fuses the input norm into linear_qkv / linear_fc1 and hides the normed
input the adapter needs (refused in check_lora).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from rlhf_mc.config import LORA_TARGETS, ConfigError, LoraConfig, ModelConfig


@dataclasses.dataclass(frozen=True)
class _Linear:
    path: str  # in the transformer layer
    parts: tuple[str, ...]  # the HF modules fused in it, in Megatron's order
    column: bool  # column-parallel (else row-parallel)
    hf_prefix: str  # the HF modules' parent in the layer


LINEARS = {
    "linear_qkv": _Linear("self_attention.linear_qkv", ("q_proj", "k_proj", "v_proj"), True, "self_attn"),
    "linear_proj": _Linear("self_attention.linear_proj", ("o_proj",), False, "self_attn"),
    "linear_fc1": _Linear("mlp.linear_fc1", ("gate_proj", "up_proj"), True, "mlp"),
    "linear_fc2": _Linear("mlp.linear_fc2", ("down_proj",), False, "mlp"),
}


def part_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF linear module: the shapes of the full B [out, r] and A [r, in]."""
    h, q, kv = model.hidden_size, model.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    ffn = model.ffn_hidden_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (ffn, h),
            "up_proj": (ffn, h), "down_proj": (h, ffn)}


def adapter_shapes(model: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """PEFT name -> shape of every full adapter tensor of the model: A [r, in] and B [out, r] of each target in each
    layer."""
    shapes = part_shapes(model)
    return {peft_name(layer, part, m): (lora.rank, shapes[part][1]) if m == "A" else (shapes[part][0], lora.rank)
            for layer in range(model.num_layers) for part in lora.targets for m in "AB"}


def adapter_numel(model: ModelConfig, lora: LoraConfig) -> int:
    """The adapters' parameters over the whole model."""
    return sum(math.prod(shape) for shape in adapter_shapes(model, lora).values())


def zero_adapter(model: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """PEFT tensors of an adapter that changes nothing (A = B = 0): what LoRA-serving engines start with."""
    return {name: torch.zeros(shape) for name, shape in adapter_shapes(model, lora).items()}


def check_lora(lora: LoraConfig, model: ModelConfig, use_te: bool, field: str = "actor.lora") -> None:
    """What the model's layers allow, before any process starts: one-line ConfigErrors naming the field."""
    if not lora.enabled:
        return
    if use_te:
        raise ConfigError(f"{field}.enabled: LoRA runs on the local layer spec only (Transformer Engine fuses the "
                          "input norm into linear_qkv and linear_fc1 and hides the normed input an adapter needs)")
    if model.kv_lora_rank:
        raise ConfigError(f"{field}.enabled: multi-latent attention (kv_lora_rank={model.kv_lora_rank}) has no "
                          "q_proj/k_proj/v_proj LoRA can adapt here")
    mlp = [t for t in lora.targets if t in ("gate_proj", "up_proj", "down_proj")]
    if model.num_experts and mlp:
        raise ConfigError(f"{field}.target_modules: {mlp} on a mixture-of-experts model: adapters on the experts "
                          "are not supported; target the attention (q_proj, k_proj, v_proj, o_proj)")
    shapes = part_shapes(model)
    for target in lora.targets:
        width = min(shapes[target])
        if lora.rank > width:
            raise ConfigError(f"{field}.rank: {lora.rank} exceeds the width of {target} ({width} = "
                              f"min{shapes[target]}): a rank above it adds parameters and no capacity")


class LinearAdapter(torch.nn.Module):
    """The adapters of one Megatron linear layer on this TP rank (see the module docstring for the split)."""

    def __init__(self, linear: _Linear, parts: tuple[str, ...], rows: dict[str, torch.Tensor], out_local: int,
                 in_local: int, lora: LoraConfig, dtype: torch.dtype, device):
        super().__init__()
        self.linear, self.parts, self.rank, self.scale, self.dropout = linear, parts, lora.rank, lora.scale, \
            lora.dropout
        self.out_local = out_local
        self.enabled = True
        self.A = torch.nn.ParameterDict({p: torch.nn.Parameter(torch.zeros(lora.rank, in_local, dtype=dtype,
                                                                           device=device)) for p in parts})
        self.B = torch.nn.ParameterDict({p: torch.nn.Parameter(torch.zeros(len(rows[p]), lora.rank, dtype=dtype,
                                                                           device=device)) for p in parts})
        for p in parts:
            self.register_buffer(f"rows_{p}", rows[p].to(device), persistent=False)
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        for p in parts:  # the split parameters (others are replicated: counted once in the grad norm)
            if linear.column:
                set_tensor_model_parallel_attributes(self.B[p], True, 0, 1)
            else:
                set_tensor_model_parallel_attributes(self.A[p], True, 1, 1)

    def _fused_b(self) -> torch.Tensor:
        """[out_local, parts * r]: each part's B at its rows of the fused layer, zero elsewhere."""
        if not self.linear.column:
            return self.B[self.parts[0]]
        b = self.B[self.parts[0]].new_zeros(self.out_local, len(self.parts) * self.rank)
        for i, p in enumerate(self.parts):
            b[getattr(self, f"rows_{p}"), i * self.rank:(i + 1) * self.rank] = self.B[p]
        return b

    def _a(self) -> torch.Tensor:
        return torch.cat([self.A[p] for p in self.parts]) if len(self.parts) > 1 else self.A[self.parts[0]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' share of the linear's output on this rank, for its input x."""
        from megatron.core import tensor_parallel

        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        u = F.linear(x, self._a())
        if self.linear.column:
            u = tensor_parallel.copy_to_tensor_model_parallel_region(u)
        else:
            u = tensor_parallel.reduce_from_tensor_model_parallel_region(u)
        return F.linear(u, self._fused_b()) * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A in the layout of this rank's shard of the base weight."""
        return (self._fused_b() @ self._a()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        split = {f"B.{p}": 0 for p in self.parts} if self.linear.column else {f"A.{p}": 1 for p in self.parts}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, split,
                                                   sharded_offsets)


class LayerAdapters(torch.nn.ModuleDict):
    """A transformer layer's adapters by Megatron linear name; its sharded checkpoint is its adapters' (a plain
    ModuleDict would be saved as replicated)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return {k: v for name, adapter in self.items()
                for k, v in adapter.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata).items()}


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP, Float16Module
        chunk = chunk.module
    return chunk


def _rows(model: ModelConfig, linear: str, tp: int) -> dict[str, torch.Tensor]:
    """Per part, the rows of this TP rank's fused output that the part's local B rows produce (column layers)."""
    if linear == "linear_qkv":
        groups, d = model.num_kv_heads // tp, model.head_dim
        per_group = model.num_attention_heads // model.num_kv_heads
        block = (per_group + 2) * d
        starts = torch.arange(groups) * block
        return {"q_proj": (starts[:, None] + torch.arange(per_group * d)).flatten(),
                "k_proj": (starts[:, None] + per_group * d + torch.arange(d)).flatten(),
                "v_proj": (starts[:, None] + (per_group + 1) * d + torch.arange(d)).flatten()}
    if linear == "linear_fc1":
        ffn = model.ffn_hidden_size // tp
        return {"gate_proj": torch.arange(ffn), "up_proj": ffn + torch.arange(ffn)}
    return {}


def _add_delta(adapter: LinearAdapter, module, args, output):
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def attach(chunks: list[torch.nn.Module], model: ModelConfig, lora: LoraConfig, seed: int) -> None:
    """Adds the adapters to every layer of the chunks (before DDP wraps them) and freezes the base. A is
    Kaiming-uniform as PEFT's (from a generator per layer and module, so every layout starts from the same full
    adapter), B zero: the model's outputs are the base's, bit for bit."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    shapes = part_shapes(model)
    for chunk in chunks:
        gpt = _unwrap(chunk)
        for p in gpt.parameters():
            p.requires_grad_(False)
        for layer in gpt.decoder.layers:
            adapters = {}
            for name, linear in LINEARS.items():
                parts = tuple(p for p in linear.parts if p in lora.targets)
                if not parts:
                    continue
                base = layer.get_submodule(linear.path)
                out_local, in_local = base.weight.shape
                full_in = shapes[parts[0]][1]
                rows = _rows(model, name, tp) if linear.column else {parts[0]: torch.arange(out_local)}
                adapter = LinearAdapter(linear, parts, rows, out_local, in_local, lora, base.weight.dtype,
                                        base.weight.device)
                for i, p in enumerate(parts):
                    a = torch.empty(lora.rank, full_in)
                    generator = torch.Generator().manual_seed(seed * 1_000_003 + (layer.layer_number - 1) * 31 +
                                                              LORA_TARGETS.index(p))
                    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
                    with torch.no_grad():
                        adapter.A[p].copy_(a if linear.column else a.chunk(tp, dim=1)[tp_rank])
                base.register_forward_hook(functools.partial(_add_delta, adapter))
                adapters[name] = adapter
            layer.lora = LayerAdapters(adapters)


def adapters(chunks) -> Iterator[tuple[int, int, str, LinearAdapter]]:
    """(chunk index, global layer index, Megatron linear name, adapter) of this rank."""
    for index, chunk in enumerate(chunks):
        for layer in _unwrap(chunk).decoder.layers:
            for name, adapter in getattr(layer, "lora", {}).items():
                yield index, layer.layer_number - 1, name, adapter


@contextlib.contextmanager
def adapters_off(chunks):
    """Within the block the chunks compute the base model (the adapters skipped, not zeroed)."""
    found = [a for *_, a in adapters(chunks)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def merged_weights(chunks) -> dict[tuple[int, str], LinearAdapter]:
    """(chunk index, local name of the base weight) -> the adapter whose delta_weight adds to it."""
    out = {}
    for index, chunk in enumerate(chunks):
        gpt = _unwrap(chunk)
        for j, layer in enumerate(gpt.decoder.layers):
            for name, adapter in getattr(layer, "lora", {}).items():
                out[(index, f"decoder.layers.{j}.{adapter.linear.path}.weight")] = adapter
    return out


def is_adapter_parameter(local_name: str) -> bool:
    return ".lora." in local_name


# ------------------------------------------------------------ PEFT's full tensors <-> this rank's shards

def peft_name(layer: int, part: str, matrix: str) -> str:
    """The tensor's name in a PEFT adapter_model.safetensors of a causal LM."""
    linear = next(lin for lin in LINEARS.values() if part in lin.parts)
    return f"base_model.model.model.layers.{layer}.{linear.hf_prefix}.{part}.lora_{matrix}.weight"


def load_full(chunks, tensors: dict[str, torch.Tensor]) -> None:
    """Sets this rank's adapter shards from full PEFT tensors (peft_name -> tensor); every adapter must be there."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for _, layer, _, adapter in adapters(chunks):
        for p in adapter.parts:
            a, b = tensors[peft_name(layer, p, "A")], tensors[peft_name(layer, p, "B")]
            if adapter.linear.column:
                b = b.chunk(tp, dim=0)[tp_rank]
            else:
                a = a.chunk(tp, dim=1)[tp_rank]
            with torch.no_grad():
                adapter.A[p].copy_(a)
                adapter.B[p].copy_(b)


def full_tensors(chunks, of=lambda param: param.detach()) -> dict[str, torch.Tensor]:
    """The whole adapter as PEFT tensors, on global rank 0 ({} elsewhere); `of`: what of each parameter (its
    gradient: `lambda p: p.main_grad`). Collective over every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    first_replica = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    # each replica-0 rank: (name, TP rank, split dim or None, its shard); the rest of the TP ranks send only splits
    local = []
    if first_replica:
        for _, layer, _, adapter in adapters(chunks):
            for p in adapter.parts:
                for matrix, dim in (("A", None if adapter.linear.column else 1), ("B", 0 if adapter.linear.column
                                                                                  else None)):
                    if dim is not None or tp_rank == 0:
                        # a copy: the parameter is a view of DDP's buffer of every adapter, which pickling
                        # would send whole
                        shard = of(getattr(adapter, matrix)[p]).to("cpu", copy=True)
                        local.append((peft_name(layer, p, matrix), tp_rank, dim, shard))
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return {}
    pieces: dict[str, dict[int, tuple[int | None, torch.Tensor]]] = {}
    for items in gathered:
        for name, rank, dim, shard in items:
            pieces.setdefault(name, {})[rank] = (dim, shard)
    out = {}
    for name, by_rank in pieces.items():
        dim = by_rank[0][0]
        out[name] = by_rank[0][1] if dim is None else torch.cat([by_rank[r][1] for r in range(tp)], dim=dim)
    return dict(sorted(out.items()))
