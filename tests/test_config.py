"""Config validation: every bad value is a one-line ConfigError that names the field and the value."""

from __future__ import annotations

import pytest
import yaml

from rlhf_mc.config import ConfigError, ModelConfig, OptimizerConfig, ParallelConfig, from_dict

TINY = dict(family="llama", hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2, head_dim=16,
            ffn_hidden_size=128, vocab_size=256, max_position_embeddings=512)


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("change, expected", [
    ({"hidden_size": "64"}, "hidden_size: expected int, got str '64'"),
    ({"num_layers": True}, "num_layers: expected int, got True"),
    ({"family": "gpt2"}, "family: 'gpt2' is not one of ['llama', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe', 'glm4_moe', "
                         "'deepseek_v3']"),
    ({"num_experts": 4}, "num_experts: 4 with family=llama (qwen3_moe, glm4_moe, deepseek_v3 models have experts, "
                         "the others none)"),
    ({"family": "qwen3_moe", "num_experts": 4, "moe_topk": 5, "moe_ffn_hidden_size": 32},
     "moe_topk: must lie in [1, num_experts=4], got 5"),
    ({"family": "qwen3_moe", "num_experts": 4, "moe_topk": 2}, "moe_ffn_hidden_size: must be >= 1, got 0"),
    ({"moe_topk": 2}, "moe_topk: 2 is set for a dense model (num_experts=0)"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.type: yarn is supported with multi-latent "
                                                        "attention only"),
    ({"rope_scaling": {"factor": 8.0, "beta_fast": 16}}, "rope_scaling.beta_fast: 16.0 is not read by type=llama3"),
    ({"kv_lora_rank": 32}, "kv_lora_rank: 32 with family=llama (deepseek_v3 models have multi-latent attention"),
    ({"family": "glm4_moe", "num_experts": 8, "moe_topk": 2, "moe_ffn_hidden_size": 32, "moe_router_score": "sigmoid",
      "moe_groups": 4, "moe_group_topk": 2}, "moe_group_topk: 2 with moe_topk=2: grouped routing needs moe_topk = 2"),
    ({"family": "glm4_moe", "num_experts": 8, "moe_topk": 2, "moe_ffn_hidden_size": 32, "moe_router_score": "sigmoid"},
     "moe_norm_topk_prob: false with the sigmoid router is not supported"),
    ({"num_kv_heads": 3}, "num_kv_heads: 3 does not divide num_attention_heads=4"),
    ({"vocab_size": 0}, "vocab_size: must be positive, got 0"),
    ({"hiden_size": 64}, "hiden_size: unknown key"),
    ({"rope_scaling": {"factor": "x"}}, "rope_scaling.factor: expected float, got str 'x'"),
    ({"rope_scaling": {"factor": 8.0, "high_freq_factor": 2.0}}, "rope_scaling.high_freq_factor: 2.0 is not supported"),
])
def test_model_config_errors_name_the_field(change, expected):
    assert expected in _error(from_dict, ModelConfig, {**TINY, **change})


def test_missing_required_key():
    data = dict(TINY)
    del data["vocab_size"]
    assert _error(from_dict, ModelConfig, data) == "vocab_size: required key is missing"


def test_from_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "head_dim": 16.5}))
    assert _error(ModelConfig.from_yaml, path) == f"{path}: head_dim: expected int, got float 16.5"
    assert "config file not found" in _error(ModelConfig.from_yaml, tmp_path / "missing.yaml")


def test_int_is_accepted_for_float_and_yaml_name_defaults_to_stem(tmp_path):
    path = tmp_path / "my-model.yaml"
    path.write_text(yaml.safe_dump({**TINY, "rope_theta": 10000}))
    config = ModelConfig.from_yaml(path)
    assert config.rope_theta == 10000.0 and isinstance(config.rope_theta, float)
    assert config.name == "my-model"


@pytest.mark.parametrize("parallel, world, expected", [
    (dict(tp=3), 3, "tp: 3 does not divide model.num_attention_heads=4"),
    (dict(pp=3), 3, "pp: pp*vpp = 3*1 = 3 does not divide model.num_layers=4"),
    (dict(pp=2, vpp=4), 2, "pp: pp*vpp = 2*4 = 8 does not divide model.num_layers=4"),
    (dict(tp=2, cp=2), 6, "world size 6 is not divisible by tp*pp*cp = 2*1*2 = 4"),
    (dict(vpp=2), 2, "vpp: 2 needs pp > 1"),
    (dict(tp=0), 1, "tp: must be >= 1, got 0"),
    (dict(ep=2), 2, "ep: 2 needs a mixture-of-experts model; llama is dense"),
    (dict(ep=3, _moe=True), 3, "ep: 3 does not divide model.num_experts=4"),
    (dict(ep=4, pp=2, _moe=True), 4, "ep: 4 does not divide tp*cp*dp = 1*1*2 (the ranks of a pipeline stage)"),
])
def test_parallel_layout_errors(parallel, world, expected):
    model = ModelConfig(**(MOE if parallel.pop("_moe", False) else TINY))

    def check():
        layout = ParallelConfig(**parallel)
        layout.check_model(model)
        layout.dp(world)

    assert expected in _error(check)


MOE = {**TINY, "family": "qwen3_moe", "num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 32}


def test_dp_is_derived():
    assert ParallelConfig(tp=2).dp(6) == 3
    assert ParallelConfig(tp=2, pp=2, cp=2).dp(16) == 2
    # EP splits a stage's tp*cp*dp ranks: ep=2 fits inside tp=2, ep=2 alone needs two data-parallel ranks
    assert ParallelConfig(tp=2, ep=2).min_world_size == 2 and ParallelConfig(ep=2, pp=2).min_world_size == 4
    assert ParallelConfig(tp=2, ep=4).min_world_size == 4 and ParallelConfig(tp=2, ep=4).dp(4) == 2
    ParallelConfig(tp=2, ep=2).check_model(ModelConfig(**{**MOE, "ffn_hidden_size": 127}))  # experts are whole


@pytest.mark.parametrize("kwargs, expected", [
    (dict(lr=0.0), "lr: must be positive, got 0.0"),
    (dict(betas=(0.9, 1.5)), "betas: expected two values in [0, 1), got [0.9, 1.5]"),
    (dict(lr_decay_style="cosine"), "lr_decay_steps: lr_decay_style='cosine' needs lr_decay_steps > 0"),
    (dict(lr_warmup_steps=10, lr_decay_steps=5), "lr_decay_steps: 5 must exceed lr_warmup_steps=10"),
    (dict(min_lr=1.0, lr=0.1), "min_lr: 1.0 must lie in [0, lr=0.1]"),
])
def test_optimizer_config_errors(kwargs, expected):
    assert expected in _error(OptimizerConfig, **kwargs)
