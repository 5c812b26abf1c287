"""Typed configs, loaded from YAML and validated at the edge.

Every error names the key path and the offending value, in one line, before any work starts. Inside the package the
dataclasses are trusted.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhf_mc.algorithms.core import Aggregation, KLEstimator, RejectLevel


_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type, or inconsistent. The message names the key path."""


def check_at_least(config: Any, minimum: float, *names: str) -> None:
    """A ConfigError naming the first of `names` whose value in `config` is below `minimum`."""
    for name in names:
        if getattr(config, name) < minimum:
            raise ConfigError(f"{name}: must be >= {minimum}, got {getattr(config, name)}")


def import_by_path(field: str, path: str) -> Any:
    """The callable at 'package.module:function' (a recipe's extension point), or a ConfigError naming `field`."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{field}: {path!r} is not 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{field}: cannot import {path!r} ({e})") from None
    if not callable(fn):
        raise ConfigError(f"{field}: {path!r} is not callable")
    return fn


def builtin_or_import(field: str, name: str, builtins: dict[str, Any]) -> Any:
    """`builtins[name]`, or the callable at 'package.module:function'; a ConfigError naming `field` otherwise."""
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise ConfigError(f"{field}: {name!r} is neither a built-in ({', '.join(builtins)}) nor "
                          "'package.module:function'")
    return import_by_path(field, name)


def _check_type(value: Any, tp: Any, path: str) -> Any:
    """Returns `value` converted to `tp` where that is lossless (int -> float), else raises ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        arms = [arm for arm in typing.get_args(tp) if arm is not type(None)]
        if value is None and len(arms) < len(typing.get_args(tp)):
            return None
        if len(arms) == 1:  # Optional[X]: X's own error says more than "not X | None"
            return _check_type(value, arms[0], path)
        for arm in arms:
            try:
                return _check_type(value, arm, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: {value!r} is not {_type_name(tp)}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: expected null, got {value!r}")
        return None
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return origin(_check_type(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        for k in value:
            if key_tp is str and not isinstance(k, str):
                raise ConfigError(f"{path}: key {k!r} is not a string (YAML reads yes, no, on, off as booleans and "
                                  "digits as numbers: quote it)")
        return {k: _check_type(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Builds dataclass `cls` from a mapping; unknown keys, missing required keys and wrong types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"{where}: unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, field in fields.items():
        key_path = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _check_type(data[name], hints[name], key_path)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key_path}: required key is missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}.{e}" if path else str(e)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys in a mapping (a second `actor:` block silently replaces the first):
    refused, with both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"{self.name}:{key_node.start_mark.line + 1}: key {key!r} given twice (first at "
                                  f"line {seen[key] + 1}): the second would replace the first")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: Llama-3.1's (llama3, Megatron-Core's RotaryEmbedding) or YaRN (DeepSeek-V3's, which
    Megatron-Core implements for multi-latent attention)."""

    type: Literal["llama3", "yarn"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn
    mscale_all_dim: float = 0.0  # yarn

    def __post_init__(self):
        # Megatron-Core hard-codes these three in RotaryEmbedding._apply_scaling; only `factor` is a parameter.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        own = {"llama3": ("low_freq_factor", "high_freq_factor"), "yarn": ("beta_fast", "beta_slow", "mscale",
                                                                          "mscale_all_dim")}
        for name in own["yarn" if self.type == "llama3" else "llama3"]:
            if getattr(self, name) != getattr(RopeScaling, name):
                raise ConfigError(f"rope_scaling.{name}: {getattr(self, name)!r} is not read by type={self.type}")
        for name, value in fixed.items() if self.type == "llama3" else ():
            if getattr(self, name) != value:
                raise ConfigError(f"rope_scaling.{name}: {getattr(self, name)!r} is not supported "
                                  f"(Megatron-Core's llama3 rope scaling fixes it to {value})")


MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model. Field names follow the published HF configs where they exist."""

    family: Literal["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "glm4_moe", "deepseek_v3"]
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm: Literal["rmsnorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    activation: Literal["swiglu"] = "swiglu"
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    rotary_percent: float = 1.0  # the share of each head's dims rotated (the first ones; HF partial_rotary_factor)
    # Multi-latent attention (DeepSeek-V3; kv_lora_rank > 0): queries through a q_lora_rank latent (0: projected
    # directly), keys and values through a kv_lora_rank latent; per head, head_dim query/key dims without rotary
    # embedding and qk_rope_head_dim with it (one rotary key shared by the heads), v_head_dim value dims.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts (0 experts: a dense model). Qwen3-MoE: softmax over the experts' logits, the top moe_topk
    # kept, renormalized over those when moe_norm_topk_prob. DeepSeek-V3 style (GLM-4.5): sigmoid scores, chosen
    # with a per-expert bias added (moe_expert_bias) among the moe_group_topk best of moe_groups expert groups,
    # renormalized, times moe_routed_scaling; shared experts beside the routed ones. Dense layers (an MLP of
    # ffn_hidden_size) among the MoE ones: moe_dense_layers N = the first N (DeepSeek's first_k_dense_replace), or
    # a list of layer indices (Qwen3-MoE's mlp_only_layers and decoder_sparse_step; Megatron's per-layer pattern).
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False
    moe_router_score: Literal["softmax", "sigmoid"] = "softmax"
    moe_expert_bias: bool = False
    moe_groups: int = 1
    moe_group_topk: int = 1
    moe_routed_scaling: float = 1.0
    moe_shared_ffn_hidden_size: int = 0  # all shared experts together; 0: none
    moe_dense_layers: int | tuple[int, ...] = 0
    name: str = ""

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                     "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads: {self.num_kv_heads} does not divide "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps: must be positive, got {self.norm_eps}")
        mla = (self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim)
        if (self.family == "deepseek_v3") != (self.kv_lora_rank > 0):
            raise ConfigError(f"kv_lora_rank: {self.kv_lora_rank} with family={self.family} (deepseek_v3 models have "
                              "multi-latent attention, the others none)")
        if self.rope_scaling is not None and self.rope_scaling.type == "yarn" and not self.kv_lora_rank:
            raise ConfigError("rope_scaling.type: yarn is supported with multi-latent attention only (Megatron-Core's "
                              "GPT rotary embedding scales llama3-style)")
        if self.kv_lora_rank:
            check_at_least(self, 0, "q_lora_rank")
            check_at_least(self, 1, "v_head_dim")
            if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
                raise ConfigError(f"qk_rope_head_dim: must be even and >= 2, got {self.qk_rope_head_dim}")
            if self.num_kv_heads != self.num_attention_heads:
                raise ConfigError(f"num_kv_heads: {self.num_kv_heads} must equal num_attention_heads="
                                  f"{self.num_attention_heads} with multi-latent attention")
        elif mla != (0, 0, 0, 0):
            raise ConfigError("q_lora_rank, qk_rope_head_dim, v_head_dim: set without multi-latent attention "
                              "(kv_lora_rank=0)")
        if not 0 < self.rotary_percent <= 1:
            raise ConfigError(f"rotary_percent: must lie in (0, 1], got {self.rotary_percent}")
        if (self.family in MOE_FAMILIES) != (self.num_experts > 0):
            raise ConfigError(f"num_experts: {self.num_experts} with family={self.family} ({', '.join(MOE_FAMILIES)} "
                              "models have experts, the others none)")
        if self.num_experts:
            self._check_moe()
        else:
            for f in dataclasses.fields(self):
                if f.name.startswith("moe_") and getattr(self, f.name) != f.default:
                    raise ConfigError(f"{f.name}: {getattr(self, f.name)!r} is set for a dense model (num_experts=0)")

    def _check_moe(self) -> None:
        if not 1 <= self.moe_topk <= self.num_experts:
            raise ConfigError(f"moe_topk: must lie in [1, num_experts={self.num_experts}], got {self.moe_topk}")
        check_at_least(self, 1, "moe_ffn_hidden_size", "moe_groups", "moe_group_topk")
        check_at_least(self, 0, "moe_shared_ffn_hidden_size")
        dense = self.moe_dense_layers
        if isinstance(dense, tuple) and dense == tuple(range(len(dense))):  # a leading run: one spelling, its number
            object.__setattr__(self, "moe_dense_layers", dense := len(dense))
        if isinstance(dense, tuple):
            if list(dense) != sorted(set(dense)) or not all(0 <= i < self.num_layers for i in dense):
                raise ConfigError(f"moe_dense_layers: {list(dense)} must be increasing layer indices in [0, "
                                  f"num_layers={self.num_layers})")
            if self.family != "qwen3_moe":
                raise ConfigError(f"moe_dense_layers: {list(dense)}: {self.family} models have dense layers only "
                                  "first (first_k_dense_replace): give their number")
        elif dense < 0:
            raise ConfigError(f"moe_dense_layers: must be >= 0, got {dense}")
        if len(self.dense_layer_ids) >= self.num_layers:
            raise ConfigError(f"moe_dense_layers: {dense} leaves no MoE layer of num_layers={self.num_layers}")
        if self.num_experts % self.moe_groups or self.moe_group_topk > self.moe_groups:
            raise ConfigError(f"moe_groups, moe_group_topk: {self.moe_groups} groups of num_experts="
                              f"{self.num_experts}, {self.moe_group_topk} of them per token: need groups dividing "
                              "the experts and group_topk <= groups")
        if self.moe_groups > 1 and self.moe_topk != 2 * self.moe_group_topk:
            # a group's score is the sum of its best 2 scores (DeepSeek-V3, HF); Megatron sums topk / group_topk
            raise ConfigError(f"moe_group_topk: {self.moe_group_topk} with moe_topk={self.moe_topk}: grouped routing "
                              "needs moe_topk = 2 * moe_group_topk (a group scores its best two experts)")
        if self.moe_router_score == "softmax" and (self.moe_expert_bias or self.moe_routed_scaling != 1):
            raise ConfigError("moe_expert_bias, moe_routed_scaling: belong to the sigmoid router "
                              "(moe_router_score=sigmoid)")
        if self.moe_router_score == "sigmoid" and self.moe_topk > 1 and not self.moe_norm_topk_prob:
            raise ConfigError("moe_norm_topk_prob: false with the sigmoid router is not supported (Megatron "
                              "renormalizes the top-k scores)")

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        """The indices of the layers with a dense MLP (every layer in a dense model)."""
        if not self.num_experts:
            return tuple(range(self.num_layers))
        dense = self.moe_dense_layers
        return dense if isinstance(dense, tuple) else tuple(range(dense))

    @property
    def num_parameters(self) -> int:
        """Counted from the architecture fields alone, as the HF implementation lays the weights out."""
        H, heads = self.hidden_size, self.num_attention_heads
        if self.kv_lora_rank:  # multi-latent attention: latent projections and their norms
            q_dims = self.head_dim + self.qk_rope_head_dim
            query = (H * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * q_dims if self.q_lora_rank
                     else H * heads * q_dims)
            attention = (query + H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                         + self.kv_lora_rank * heads * (self.head_dim + self.v_head_dim) + heads * self.v_head_dim * H)
        else:
            q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
            attention = H * (q + 2 * kv) + q * H
            if self.qkv_bias:
                attention += q + 2 * kv
            if self.qk_norm:
                attention += 2 * self.head_dim
        dense_mlp = 3 * H * self.ffn_hidden_size
        moe_mlp = (self.num_experts * 3 * H * self.moe_ffn_hidden_size + self.num_experts * H  # routed experts, router
                   + 3 * H * self.moe_shared_ffn_hidden_size)
        dense = len(self.dense_layer_ids)
        mlps = dense * dense_mlp + (self.num_layers - dense) * moe_mlp
        embeddings = self.vocab_size * H * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attention + 2 * H) + mlps + embeddings + H

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelConfig":
        data = load_yaml(path)
        data.setdefault("name", Path(path).stem)
        try:
            return from_dict(cls, data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel layout. dp is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (virtual pipeline); 1 = no interleaving
    cp: int = 1
    ep: int = 1  # expert parallel (expert tensor parallel is 1: each expert whole on one rank)

    def __post_init__(self):
        check_at_least(self, 1, "tp", "pp", "vpp", "cp", "ep")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(f"vpp: {self.vpp} needs pp > 1 (virtual pipeline interleaves pipeline stages)")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def min_world_size(self) -> int:
        """The fewest ranks that hold one copy of the model: tp*pp*cp, times the data-parallel ranks that EP needs
        beyond tp*cp (EP splits a stage's ranks)."""
        return self.model_parallel_size * (self.ep // math.gcd(self.ep, self.tp * self.cp))

    def dp(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ConfigError(f"parallel: world size {world_size} is not divisible by tp*pp*cp = "
                              f"{self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size}")
        dp = world_size // self.model_parallel_size
        # Megatron's expert layout: each pipeline stage's tp*cp*dp ranks split into ep groups (expert data
        # parallel = the rest), as its attention layout splits them into tp*cp*dp.
        if (self.tp * self.cp * dp) % self.ep:
            raise ConfigError(f"ep: {self.ep} does not divide tp*cp*dp = {self.tp}*{self.cp}*{dp} (the ranks of a "
                              "pipeline stage)")
        return dp

    def check_model(self, model: ModelConfig) -> None:
        """Divisibility rules between a layout and an architecture, checked before any process starts."""
        # Routed experts are not split over TP (expert tensor parallel 1); dense MLPs and shared experts are.
        dense_mlp = bool(model.dense_layer_ids)
        for field, value in (("num_attention_heads", model.num_attention_heads),
                             ("num_kv_heads", model.num_kv_heads),
                             *((("ffn_hidden_size", model.ffn_hidden_size),) if dense_mlp else ()),
                             ("moe_shared_ffn_hidden_size", model.moe_shared_ffn_hidden_size)):
            if value % self.tp:
                raise ConfigError(f"tp: {self.tp} does not divide model.{field}={value}")
        if model.kv_lora_rank and self.tp > 1:
            raise ConfigError(f"tp: {self.tp} with multi-latent attention is not supported (the bridge maps its "
                              "latent projections at tp=1 only)")
        if self.ep > 1 and not model.num_experts:
            raise ConfigError(f"ep: {self.ep} needs a mixture-of-experts model; {model.name or model.family} is dense")
        if model.num_experts % self.ep:
            raise ConfigError(f"ep: {self.ep} does not divide model.num_experts={model.num_experts}")
        stages = self.pp * self.vpp
        if model.num_layers % stages:
            raise ConfigError(f"pp: pp*vpp = {self.pp}*{self.vpp} = {stages} does not divide "
                              f"model.num_layers={model.num_layers}")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The router of a mixture-of-experts model in training (recipe: actor.router).

    Losses (Megatron's moe_router_load_balancing_type, moe_aux_loss_coeff, moe_z_loss_coeff): a loss with
    coefficient 0 is not computed (and not logged); the logged values are the losses before their coefficient,
    averaged over the MoE layers. `replay`: rollout routing replay (models/routing.py): the actor's forward passes
    route every token to the experts the rollout engine chose; off, the agreement of the two is logged."""

    load_balancing: Literal["aux_loss", "seq_aux_loss"] = "aux_loss"  # over the micro-batch, or per sequence
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    replay: bool = False
    # models with an expert bias (DeepSeek-V3 style): how fast it moves toward balanced loads after each step
    # (Megatron's auxiliary-loss-free balancing); 0 keeps the checkpoint's
    bias_update_rate: float = 0.0

    def __post_init__(self):
        check_at_least(self, 0, "aux_loss_coef", "z_loss_coef", "bias_update_rate")


# PEFT's names of the linear modules LoRA can adapt, and its shorthand for all of them
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the actor's linear layers (models/lora.py), with PEFT's names and semantics: y = W x +
    (alpha / rank) B A dropout(x), A Kaiming-uniform and B zero at the start (the base model's outputs exactly).
    target_modules: PEFT's module names (LORA_TARGETS) or ["all-linear"]. adapter_path: a PEFT adapter directory
    to start from (its r, lora_alpha and target_modules must equal the fields here). The reference is the base with
    the adapters off. sync: "adapter" loads the adapter into SGLang's LoRA serving at every sync (the base stays);
    "merged" sends W + (alpha / rank) B A of the adapted layers only; auto: adapter on GPU where the trainer launches
    the engines (dense models), merged on CPU and otherwise. The engines' adapter endpoints accept code-bearing payloads: with sync=adapter they
    listen on loopback or the cluster's private network only, unless allow_remote_engines."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    adapter_path: str = ""
    export_merged: bool = False  # the run's end also writes the base with the adapters merged (final_hf)
    sync: Literal["auto", "adapter", "merged"] = "auto"
    allow_remote_engines: bool = False

    def __post_init__(self):
        if not self.enabled:
            given = [f.name for f in dataclasses.fields(self) if f.name != "enabled"
                     and getattr(self, f.name) != f.default]
            if given:
                raise ConfigError(f"{given[0]}: {getattr(self, given[0])!r} is read only with lora.enabled=true")
            return
        check_at_least(self, 1, "rank")
        if self.alpha <= 0:
            raise ConfigError(f"alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout: must lie in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("target_modules: empty; name PEFT modules (e.g. q_proj, v_proj) or all-linear")
        for name in self.target_modules:
            if name not in (*LORA_TARGETS, "all-linear"):
                raise ConfigError(f"target_modules: {name!r} matches no linear layer of the model (its linear "
                                  f"modules: {', '.join(LORA_TARGETS)}, or all-linear)")

    @property
    def targets(self) -> tuple[str, ...]:
        """The adapted HF modules, in LORA_TARGETS' order."""
        return tuple(t for t in LORA_TARGETS if t in self.target_modules or "all-linear" in self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adam(W) through Megatron's optimizer, with a warmup + decay learning-rate schedule."""

    lr: float = 1e-6
    min_lr: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None  # None: constant after warmup
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    use_distributed_optimizer: bool = True

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"lr: must be positive, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr: {self.min_lr} must lie in [0, lr={self.lr}]")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas: expected two values in [0, 1), got {list(self.betas)}")
        if self.clip_grad < 0:
            raise ConfigError(f"clip_grad: must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"lr_warmup_steps: must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_style != "constant" and not self.lr_decay_steps:
            raise ConfigError(f"lr_decay_steps: lr_decay_style={self.lr_decay_style!r} needs lr_decay_steps > 0")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigError(f"lr_decay_steps: {self.lr_decay_steps} must exceed lr_warmup_steps="
                              f"{self.lr_warmup_steps}")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The actor's loss (workers/train.train_step; recipe: actor.loss)."""

    mode: Literal["ppo", "gspo"] = "ppo"
    clip_low: float = 0.2
    clip_high: float | None = None  # DAPO clip-higher; null = clip_low
    dual_clip: float | None = None
    aggregation: Aggregation = "token-mean"
    kl_loss_coef: float = 0.0  # KL to the reference as a loss term (GRPO style)
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    # Rollout correction against the rollout engine's log-probs (algorithms/core.rollout_correction): truncated
    # importance sampling min(ratio, tis_cap) per token or per sequence; masked importance sampling (reject: token =
    # IcePop, sequence, geometric) drops tokens whose ratio lies outside [reject_low, reject_high]
    tis_cap: float | None = None
    tis_level: Literal["token", "sequence"] = "token"
    reject: RejectLevel = "none"
    reject_low: float = 0.5
    reject_high: float = 2.0
    # seq-mean-token-sum-norm's constant divisor; 0 in a recipe = data.max_response_length (set at load)
    norm_length: int = 0

    def __post_init__(self):
        if self.norm_length < 0:
            raise ConfigError(f"norm_length: must be >= 0, got {self.norm_length}")
        if self.norm_length and self.aggregation != "seq-mean-token-sum-norm":
            raise ConfigError(f"norm_length: {self.norm_length} is read by aggregation=seq-mean-token-sum-norm only, "
                              f"not {self.aggregation}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip: must be > 1, got {self.dual_clip}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"tis_cap: must be > 0, got {self.tis_cap}")
        if self.tis_level != "token" and self.tis_cap is None:
            raise ConfigError(f"tis_level: {self.tis_level} is read only with tis_cap set")
        if not 0 < self.reject_low < 1 < self.reject_high:
            raise ConfigError(f"reject_low, reject_high: need 0 < low < 1 < high, got {self.reject_low}, "
                              f"{self.reject_high}")
        if self.reject == "none" and (self.reject_low, self.reject_high) != (PolicyLossConfig.reject_low,
                                                                             PolicyLossConfig.reject_high):
            raise ConfigError(f"reject_low, reject_high: {self.reject_low}, {self.reject_high} are read only with "
                              "reject set (token, sequence or geometric)")
        check_at_least(self, 0, "kl_loss_coef", "entropy_coef")
        if self.clip_low <= 0 or (self.clip_high is not None and self.clip_high <= 0):
            raise ConfigError(f"clip_low, clip_high: must be > 0, got {self.clip_low}, {self.clip_high}")


# RolloutConfig's fields read only to launch a server here (its command line, its start-up wait): an attached server's
# TP size, context length and deterministic inference are read from the server itself
LAUNCH_SETTINGS = ("tp", "dtype", "context_length", "chunked_prefill_size", "max_total_tokens", "mem_fraction_static",
                   "deterministic", "base_port", "extra_args", "startup_timeout_s")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """SGLang rollout engines: launched as child processes, or attached to running servers by address."""

    model_path: str = ""  # HF checkpoint directory the servers start from (unused when attaching; the trainer sets it)
    num_engines: int = 1  # data-parallel engines, each its own SGLang server
    tp: int = 1  # tensor-parallel size of each engine
    addresses: tuple[str, ...] = ()  # "host:port" of running servers: attach instead of launching
    host: str = "127.0.0.1"
    base_port: int = 0  # 0: pick free ports
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    context_length: int | None = None  # None: the model's max_position_embeddings
    chunked_prefill_size: int | None = None
    max_total_tokens: int | None = None  # KV cache tokens; on CPU defaults to 65536 (SGLang's default reserves GBs)
    mem_fraction_static: float | None = None
    deterministic: bool = False  # --enable-deterministic-inference: honours per-sample seeds (GPU backends only)
    # mixture-of-experts models: each sample comes with the experts the server routed its tokens to
    # (--enable-return-routed-experts); the trainer sets it for MoE models
    return_routed_experts: bool = False
    # start with random weights (--load-format dummy; model_path needs a config.json alone): the trainer's first sync
    # replaces them, so its engines start beside the SFT stage and the workers, not after them (set by the trainer)
    random_weights: bool = False
    # a PEFT adapter directory the servers start with, served as LORA_NAME, which every request then generates with
    # (LoRA serving; the trainer's adapter sync replaces it: sync/transports.AdapterTensors); set by the trainer.
    # A client of attached servers that serve LORA_NAME: any non-empty value
    lora_adapter: str = ""
    # samples one engine is sent at once by a generate call: a batched request, which SGLang's scheduler batches and
    # refills; more wait for it to end
    max_concurrency: int = 1024
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_restarts: int = 3  # per engine, for crashed servers
    extra_args: tuple[str, ...] = ()  # passed to sglang.launch_server verbatim

    def __post_init__(self):
        check_at_least(self, 1, "num_engines", "tp", "max_concurrency")
        if self.addresses and len(self.addresses) != self.num_engines:
            raise ConfigError(f"addresses: {len(self.addresses)} addresses for num_engines={self.num_engines}")
        for address in self.addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"addresses: {address!r} is not host:port")
        for name in LAUNCH_SETTINGS if self.addresses else ():
            if getattr(self, name) != getattr(RolloutConfig, name):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is what a server launched here starts with; the "
                                  "servers attached by addresses keep their own: leave it out")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"context_length: must be >= 2, got {self.context_length}")


@dataclasses.dataclass(frozen=True)
class ToolsConfig:
    """The tools the policy may call in multi-turn rollouts (rlhf_mc/tools/, rollout/multi_turn.py). Each is a
    Python function named by import path ("package.module:function"); its JSON schema (name, description, typed
    arguments, from the signature and the Google-style docstring) goes to the chat template's `tools`."""

    functions: tuple[str, ...] = ()
    parser: str = "hermes"  # the tool-call format: "hermes" (<tool_call>{json}</tool_call>) or an import path
    max_turns: int = 4  # assistant turns per trajectory
    max_calls_per_turn: int = 4  # tool calls run per assistant turn; further ones get an error message
    output_tokens: int = 256  # a tool message is cut to this many tokens (and says so)
    timeout_s: float = 10.0  # per call, wall clock; the call's process is killed after it
    memory_mb: int = 1024  # per call: the address-space limit of its process
    concurrency: int = 4  # calls running at once

    def __post_init__(self):
        check_at_least(self, 1, "max_turns", "max_calls_per_turn", "output_tokens", "memory_mb", "concurrency")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if len(set(self.functions)) != len(self.functions):
            twice = sorted({f for f in self.functions if self.functions.count(f) > 1})
            raise ConfigError(f"functions: listed twice: {twice}")
