"""The shipped model configs: each loads, and the real ones reproduce their published parameter counts
(ModelConfig.num_parameters, counted from the architecture fields alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_mc.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"

# Parameter counts the model cards publish (safetensors totals), in billions.
PUBLISHED = {
    "llama3.1-8b": 8.030,
    "llama3.1-70b": 70.554,
    "qwen2.5-7b": 7.616,
    "qwen3-0.6b": 0.596,
    "qwen3-8b": 8.191,
    "mistral-7b": 7.248,
    "qwen3-30b-a3b": 30.532,
    "deepseek-v3": 671.0,  # without its multi-token-prediction layer (the card's 685B include it)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_model_matches_published_size(name):
    config = ModelConfig.from_yaml(CONFIGS / f"{name}.yaml")
    assert config.num_parameters / 1e9 == pytest.approx(PUBLISHED[name], rel=2e-3)


def test_every_config_loads_and_tiny_models_cover_each_family():
    configs = [ModelConfig.from_yaml(p) for p in sorted(CONFIGS.glob("*.yaml"))]
    assert {c.name for c in configs} >= set(PUBLISHED)
    tiny = {c.family: c for c in configs if c.name.startswith("tiny-")}
    assert set(tiny) == {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "glm4_moe", "deepseek_v3"}
    assert tiny["qwen2"].qkv_bias and tiny["qwen3"].qk_norm and tiny["qwen3"].tie_embeddings
    assert all(c.num_kv_heads < c.num_attention_heads for c in tiny.values() if not c.kv_lora_rank)  # GQA (not MLA)
