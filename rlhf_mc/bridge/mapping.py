"""Weight mapping between HF (Llama layout: Llama 2/3, Qwen2/2.5, Qwen3, Mistral; Qwen3-MoE, GLM-4.5; DeepSeek-V3's
multi-latent attention) and Megatron-Core's GPTModel.

One Rule per Megatron parameter (global layer numbering): its HF tensors, how TP shards it, and its layout:
- "plain": one HF tensor; TP splits dim `tp_dim` (None: replicated).
- "qkv":   Megatron fuses q, k, v per query group g: [q_g (heads/groups * head_dim rows); k_g; v_g] for each g, and TP
           rank r holds groups [r*G/tp, (r+1)*G/tp). HF keeps q_proj, k_proj, v_proj apart.
- "gate_up": Megatron's SwiGLU fc1 on TP rank r is [gate_r; up_r]; gathering TP shards is an un-interleave, not a
           concat.
Experts (expert tensor parallel 1: never split over TP) are named here by their global index e, whichever EP rank
holds them: `decoder.layers.L.mlp.experts.local_experts.e.linear_fc{1,2}.weight` (bridge/weights.py renames the local
names of Megatron's SequentialMLP and TE's grouped MLP to it); fc1 is [gate_e; up_e], fc2 is down_e, the router is
HF's `mlp.gate` (its expert bias, a buffer, HF's `e_score_correction_bias`); shared experts are a TP-split MLP.
Shards are read from / assembled to HF tensors here; nothing else in the package knows these layouts.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, Protocol

import torch

from rlhf_mc.config import ModelConfig


class Reader(Protocol):
    def shape(self, name: str) -> list[int]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The slice [start:stop) of an HF tensor along dim (dim None: the whole tensor)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron_name: str  # global name, e.g. decoder.layers.7.self_attention.linear_qkv.weight
    hf_names: tuple[str, ...]
    layout: Literal["plain", "qkv", "gate_up"] = "plain"
    tp_dim: int | None = None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron parameter (suffix inside a layer; TE spec names after the |) -> (HF suffix(es) in the layer, layout, tp dim)
_LAYER_RULES = {
    "input_layernorm.weight|self_attention.linear_qkv.layer_norm_weight":
        (("input_layernorm.weight",), "plain", None),
    "self_attention.linear_qkv.weight":
        (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", 0),
    "self_attention.linear_qkv.bias":
        (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv", 0),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "plain", None),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "plain", None),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "plain", 1),
    "pre_mlp_layernorm.weight|mlp.linear_fc1.layer_norm_weight":
        (("post_attention_layernorm.weight",), "plain", None),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 0),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "plain", 1),
    "mlp.router.weight": (("mlp.gate.weight",), "plain", None),
    "mlp.router.expert_bias": (("mlp.gate.e_score_correction_bias",), "plain", None),  # a buffer
    "mlp.shared_experts.linear_fc1.weight": (("mlp.shared_experts.gate_proj.weight",
                                              "mlp.shared_experts.up_proj.weight"), "gate_up", 0),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_experts.down_proj.weight",), "plain", 1),
}
# Multi-latent attention (models with kv_lora_rank > 0), TP=1 only (ParallelConfig.check_model), one HF tensor each,
# same layout (Megatron's MLA rotates DeepSeek's interleaved rotary pairs itself); its latent norms take the names of
# Qwen3's q/k norms in Megatron
_MLA_RULES = {
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight|self_attention.linear_q_up_proj.layer_norm_weight":
        "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight|self_attention.linear_kv_up_proj.layer_norm_weight":
        "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_MLA_RULES = {name: rule for names, rule in _MLA_RULES.items() for name in names.split("|")}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc(1|2)\.weight$")
_LAYER_RULES = {name: rule for names, rule in _LAYER_RULES.items() for name in names.split("|")}


def rule_for(megatron_name: str, model: ModelConfig) -> Rule:
    """The rule of a Megatron parameter given by its global name; KeyError names an unmapped parameter."""
    if megatron_name == "embedding.word_embeddings.weight":
        return Rule(megatron_name, ("model.embed_tokens.weight",), "plain", 0)
    if megatron_name == "output_layer.weight":
        # With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding.
        hf = "model.embed_tokens.weight" if model.tie_embeddings else "lm_head.weight"
        return Rule(megatron_name, (hf,), "plain", 0)
    if megatron_name == "decoder.final_layernorm.weight":
        return Rule(megatron_name, ("model.norm.weight",), "plain", None)
    match = _LAYER.match(megatron_name)
    if match and model.kv_lora_rank and match.group(2) in _MLA_RULES:
        layer, suffix = match.groups()
        return Rule(megatron_name, (f"model.layers.{layer}.{_MLA_RULES[suffix]}",), "plain", None)
    if match and match.group(2) in _LAYER_RULES:
        layer, suffix = match.groups()
        hf_suffixes, layout, tp_dim = _LAYER_RULES[suffix]
        return Rule(megatron_name, tuple(f"model.layers.{layer}.{s}" for s in hf_suffixes), layout, tp_dim)
    expert = _EXPERT.match(match.group(2)) if match else None
    if expert:
        prefix = f"model.layers.{match.group(1)}.mlp.experts.{expert.group(1)}"
        if expert.group(2) == "1":
            return Rule(megatron_name, (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"), "gate_up", None)
        return Rule(megatron_name, (f"{prefix}.down_proj.weight",), "plain", None)
    raise KeyError(f"no HF mapping for Megatron parameter {megatron_name}")


def fused_group(rule: Rule) -> str | None:
    """Parameters SGLang must receive in one weight-update call: it fuses DeepSeek-V3's q_a_proj and
    kv_a_proj_with_mqa into one tensor and silently drops a half that arrives without the other
    (deepseek_weight_loader.py: cached_a_proj lives for one load_weights call). None for every other parameter."""
    match = _LAYER.match(rule.megatron_name)
    if match and match.group(2) in ("self_attention.linear_q_down_proj.weight",
                                    "self_attention.linear_kv_down_proj.weight"):
        return f"layer {match.group(1)} latent down projections"
    return None


def expert_index(megatron_name: str) -> int | None:
    """The global expert index of an expert's parameter (global name), None for every other parameter."""
    match = _LAYER.match(megatron_name)
    expert = _EXPERT.match(match.group(2)) if match else None
    return int(expert.group(1)) if expert else None


def is_exported(rule: Rule, model: ModelConfig) -> bool:
    """Tied models export the embedding once (from the first stage), not the last stage's copy."""
    return not (model.tie_embeddings and rule.megatron_name == "output_layer.weight")


def _qkv_sizes(model: ModelConfig) -> tuple[int, int]:
    """(rows of q per query group, rows of k (= of v) per group)."""
    return model.num_attention_heads // model.num_kv_heads * model.head_dim, model.head_dim


def read_shard(rule: Rule, reader: Reader, model: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of the Megatron parameter, reading only the HF slices it needs."""
    read = reader.read
    if rule.tp_dim is None:  # replicated over TP: every rank reads the whole parameter
        tp_rank, tp_size = 0, 1
    if rule.layout == "plain":
        if rule.tp_dim is None:
            return read(rule.hf_names[0])
        step = reader.shape(rule.hf_names[0])[rule.tp_dim] // tp_size
        return read(rule.hf_names[0], rule.tp_dim, tp_rank * step, (tp_rank + 1) * step)
    if rule.layout == "gate_up":
        step = reader.shape(rule.hf_names[0])[0] // tp_size
        return torch.cat([read(name, 0, tp_rank * step, (tp_rank + 1) * step) for name in rule.hf_names])
    q_rows, kv_rows = _qkv_sizes(model)
    groups = model.num_kv_heads // tp_size
    first = tp_rank * groups
    q, k, v = (read(name, 0, first * rows, (first + groups) * rows)
               for name, rows in zip(rule.hf_names, (q_rows, kv_rows, kv_rows)))
    per_group = [t.reshape(groups, rows, *t.shape[1:]) for t, rows in ((q, q_rows), (k, kv_rows), (v, kv_rows))]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def shard_pieces(rule: Rule, shard: torch.Tensor, model: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """read_shard's inverse: a TP rank's shard of the Megatron parameter as its slices of the HF tensors, views of
    `shard` (no copy). Rank r of n holds the r-th of n equal slices of each along rule.tp_dim (dim 0 for the fused
    layouts). An attention slice comes grouped, [query groups, rows per group, ...]: its HF rows, flattened."""
    if rule.layout == "plain":
        return [(rule.hf_names[0], shard)]
    if rule.layout == "gate_up":
        return list(zip(rule.hf_names, shard.chunk(2, dim=0)))
    q_rows, kv_rows = _qkv_sizes(model)  # a shard holds consecutive query groups: [q; k; v] per group
    grouped = shard.reshape(-1, q_rows + 2 * kv_rows, *shard.shape[1:])
    return list(zip(rule.hf_names, grouped.split([q_rows, kv_rows, kv_rows], dim=1)))


def to_hf(rule: Rule, full: torch.Tensor, tp_size: int, model: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors from the Megatron parameter's TP shards concatenated in rank order along rule.tp_dim.
    Plain parameters come back as `full` itself (no copy); fused ones are one copy each."""
    if rule.layout == "plain":
        return [(rule.hf_names[0], full)]
    per_rank = [shard_pieces(rule, shard, model) for shard in full.chunk(tp_size, dim=0)]
    return [(name, torch.cat([pieces[i][1] for pieces in per_rank]).reshape(-1, *full.shape[1:]))
            for i, name in enumerate(rule.hf_names)]
