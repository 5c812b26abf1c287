"""HF config.json <-> ModelConfig, per supported architecture.

Reads both transformers 5.x configs (rope settings in `rope_parameters`) and the 4.x layout most published checkpoints
carry (`rope_theta`, `rope_scaling` at the top level). Anything the Megatron model would compute differently (a
sliding window, a rope type Megatron lacks, an activation other than SiLU) is refused with the field named.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rlhf_mc.config import ConfigError, ModelConfig, RopeScaling

# HF architecture -> our family. All share the Llama weight layout; the differences are config switches (and the
# MoE families' routed experts in place of the MLP, DeepSeek-V3's multi-latent attention in place of GQA).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    # Reward models: the same decoder with a scalar head ("score.weight") instead of the vocabulary projection.
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "MistralForSequenceClassification": "mistral",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "qwen3_moe": "qwen3_moe",
                "glm4_moe": "glm4_moe", "deepseek_v3": "deepseek_v3"}


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ("llama3", "yarn"):
        raise ConfigError(f"rope_parameters.rope_type: {rope_type!r} is not supported (default, llama3 or yarn)")
    if rope_type == "yarn" and (not scaling.get("truncate", True) or scaling.get("attention_factor") is not None):
        raise ConfigError("rope_parameters: yarn with truncate=false or an explicit attention_factor is not supported")
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"type"}
    values = {k: v for k, v in scaling.items() if k in fields and v is not None}
    return float(theta), RopeScaling(type=rope_type, **values)


def model_config_from_hf(hf: dict, name: str = "") -> ModelConfig:
    """The ModelConfig of an HF config.json dict; ConfigError naming the field for anything unsupported."""
    architectures = hf.get("architectures") or []
    arch = next((a for a in architectures if a in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"architectures: {architectures} is not supported (supported: {', '.join(ARCHITECTURES)})")
    family = ARCHITECTURES[arch]
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: {hf['hidden_act']!r} is not supported (silu)")
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", family == "mistral")
    if uses_window and window is not None and window < hf["max_position_embeddings"]:
        raise ConfigError(f"sliding_window: {window} is not supported (the Megatron model attends to the full "
                          f"context; max_position_embeddings={hf['max_position_embeddings']})")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias: true is not supported")
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    moe = {"qwen3_moe": _qwen3_moe, "glm4_moe": _deepseek_moe, "deepseek_v3": _deepseek_moe}.get(family,
                                                                                             lambda hf: {})(hf)
    mla = _mla(hf) if family == "deepseek_v3" else {}
    rotary = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return ModelConfig(
        family=family,
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=mla.pop("head_dim", None) or hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(hf.get("attention_bias", family == "qwen2")),
        qk_norm=family in ("qwen3", "qwen3_moe") or bool(hf.get("use_qk_norm")),
        rotary_percent=float(rotary),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        name=name,
        **moe,
        **mla,
    )


def _qwen3_moe(hf: dict) -> dict:
    """Qwen3-MoE's expert fields (published configs say num_experts, transformers 5 writes num_local_experts).
    Layer i is an MoE layer when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (transformers'
    Qwen3MoeDecoderLayer); the others are dense MLPs of intermediate_size: a leading run of them is moe_dense_layers
    N (as DeepSeek's), any other set the list of their indices."""
    step, only = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)
    return dict(num_experts=hf.get("num_experts") or hf["num_local_experts"], moe_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_norm_topk_prob=bool(hf.get("norm_topk_prob")),
                moe_dense_layers=dense)


def _deepseek_moe(hf: dict) -> dict:
    """DeepSeek-V3's (and GLM-4.5's) expert fields: sigmoid router with a correction bias, grouped top-k, scaled
    weights, shared experts, the first first_k_dense_replace layers dense. Their multi-token-prediction layers
    (num_nextn_predict_layers) are not part of the causal LM: not loaded, not exported."""
    if not hf.get("norm_topk_prob", True) and hf["num_experts_per_tok"] > 1:
        raise ConfigError("norm_topk_prob: false is not supported with the sigmoid router (Megatron renormalizes "
                          "the top-k scores)")
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1 and hf["num_experts_per_tok"] != 2 * group_topk:
        raise ConfigError(f"topk_group: {group_topk} with num_experts_per_tok={hf['num_experts_per_tok']} is not "
                          f"supported (n_group={groups}: Megatron scores a group by its top num_experts_per_tok / "
                          "topk_group experts, HF by its top 2)")
    return dict(num_experts=hf.get("n_routed_experts") or hf["num_local_experts"], moe_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_norm_topk_prob=bool(hf.get("norm_topk_prob")),
                moe_router_score="sigmoid", moe_expert_bias=True, moe_groups=groups, moe_group_topk=group_topk,
                moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                moe_shared_ffn_hidden_size=hf.get("n_shared_experts", 0) * hf["moe_intermediate_size"],
                moe_dense_layers=hf.get("first_k_dense_replace", 0))


def _mla(hf: dict) -> dict:
    """DeepSeek-V3's multi-latent attention fields; head_dim is the query/key dims without rotary embedding."""
    if not hf.get("rope_interleave", True):
        raise ConfigError("rope_interleave: false is not supported (Megatron's multi-latent attention rotates "
                          "interleaved pairs)")
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias: true is not supported with multi-latent attention")
    if hf.get("rms_norm_eps", 1e-6) != 1e-6:
        raise ConfigError(f"rms_norm_eps: {hf['rms_norm_eps']} is not supported with multi-latent attention (HF's "
                          "latent norms fix 1e-6, Megatron's take the model's)")
    return dict(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], head_dim=hf["qk_nope_head_dim"])


def check_matches(model: ModelConfig, hf: dict) -> None:
    """Refuses an HF checkpoint whose config differs from `model` in any architecture field, naming it."""
    derived = model_config_from_hf(hf, name=model.name)
    for field in dataclasses.fields(ModelConfig):
        if field.name == "name":
            continue
        ours, theirs = getattr(model, field.name), getattr(derived, field.name)
        if ours != theirs:
            raise ConfigError(f"{field.name}: model config has {ours!r} but the HF checkpoint's config.json has "
                              f"{theirs!r}")


def hf_config_from_model(model: ModelConfig, dtype: str = "float32") -> dict:
    """A transformers config.json for `model` (used when exporting a checkpoint that did not come from HF)."""
    arch = next(a for a, f in ARCHITECTURES.items() if f == model.family)
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        scaling = model.rope_scaling
        rope = {**dataclasses.asdict(scaling), "rope_type": scaling.type, "rope_theta": model.rope_theta}
        unread = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim") if scaling.type == "llama3" else (
            "low_freq_factor", "high_freq_factor")
        for name in ("type", *unread):
            rope.pop(name)
    config = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[model.family],
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.ffn_hidden_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rope_parameters": rope,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": model.tie_embeddings,
        "dtype": dtype,
    }
    if model.family in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = model.qkv_bias
    if model.family == "qwen3_moe":
        config.update(num_experts=model.num_experts, num_experts_per_tok=model.moe_topk,
                      moe_intermediate_size=model.moe_ffn_hidden_size, norm_topk_prob=model.moe_norm_topk_prob,
                      decoder_sparse_step=1, mlp_only_layers=list(model.dense_layer_ids))
    if model.family in ("glm4_moe", "deepseek_v3"):
        config.update(n_routed_experts=model.num_experts, num_experts_per_tok=model.moe_topk,
                      moe_intermediate_size=model.moe_ffn_hidden_size, norm_topk_prob=model.moe_norm_topk_prob,
                      n_group=model.moe_groups, topk_group=model.moe_group_topk,
                      routed_scaling_factor=model.moe_routed_scaling,
                      n_shared_experts=model.moe_shared_ffn_hidden_size // model.moe_ffn_hidden_size,
                      first_k_dense_replace=model.moe_dense_layers, attention_bias=model.qkv_bias,
                      num_nextn_predict_layers=0)
    if model.family == "glm4_moe":
        config["use_qk_norm"] = model.qk_norm
    if model.family == "deepseek_v3":
        config.update(q_lora_rank=model.q_lora_rank or None, kv_lora_rank=model.kv_lora_rank,
                      qk_nope_head_dim=model.head_dim, qk_rope_head_dim=model.qk_rope_head_dim,
                      v_head_dim=model.v_head_dim, head_dim=model.qk_rope_head_dim, rope_interleave=True,
                      # what published DeepSeek-V3 configs say and SGLang reads (transformers does not write them)
                      moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
    if model.rotary_percent != 1:
        config["rope_parameters"]["partial_rotary_factor"] = model.rotary_percent
        config["partial_rotary_factor"] = model.rotary_percent
    if model.family == "mistral":
        config["sliding_window"] = None
    return config
