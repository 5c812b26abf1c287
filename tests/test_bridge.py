"""HF <-> Megatron bridge against transformers, for a random tiny model of every supported family.

- Megatron logits after load_hf_weights equal transformers' (fp32, 1e-4) at TP in {1,2} x PP in {1,2}, and the
  streaming export at that layout gives back every HF tensor bitwise; for the MoE families (Qwen3-MoE, GLM-4.5,
  DeepSeek-V3 with multi-latent attention, which the bridge maps at TP=1 only) also at EP=2 with TP and PP.
- The CLI: hf -> mcore (TP=2 x PP=2) -> hf (loaded at TP=1) is bitwise equal; tools/score.py equals transformers'
  log-probs; bad input is a one-line error with exit code 2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
from rlhf_mc.bridge.safetensors_io import HFCheckpoint
from rlhf_mc.config import ParallelConfig
from rlhf_mc.runtime.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _write_hf_model(family: str, out: Path) -> None:
    import transformers as T

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5)
    model = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192})),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**common)),  # qkv bias
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**common, tie_word_embeddings=True)),  # q/k norm, tied
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=None)),
        # 4 experts, top-2 renormalized; layer 2 a dense MLP among the MoE layers (Megatron's per-layer pattern: at
        # PP=2 the second stage holds a dense and an MoE layer)
        "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[2])),
        # DeepSeek-V3-style MoE: sigmoid router with a correction bias, 2 groups of 4 experts (1 chosen per token),
        # scaled weights, a shared expert, layer 0 dense; half the head dims rotated, q/k norms, qkv bias
        "glm4_moe": lambda: T.Glm4MoeForCausalLM(T.Glm4MoeConfig(
            **common, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
            partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0)),
        # the same MoE with multi-latent attention: q and kv latents of 32, 16 + 8 rotary (interleaved, YaRN-scaled
        # as DeepSeek-V3's) query/key dims per head, 16 value dims
        "deepseek_v3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4, "head_dim": 8, "rms_norm_eps": 1e-6}, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, num_nextn_predict_layers=0)),
    }[family]()
    torch.manual_seed(1)
    with torch.no_grad():  # far from init (norms at 1, biases at 0) so that any layout mistake shows
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("inv_freq"):
                continue
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size="60KB")  # several shards + index
    if family == "deepseek_v3":  # what published DeepSeek-V3 configs carry and SGLang reads; transformers omits them
        config = json.loads((out / "config.json").read_text())
        config.update(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer_config.json").write_text('{"model_max_length": 512}\n')


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "glm4_moe", "deepseek_v3"]
MOE = ["qwen3_moe", "glm4_moe", "deepseek_v3"]
TP1_ONLY = ["deepseek_v3"]  # multi-latent attention: the bridge maps it at TP=1


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {family: root / family for family in FAMILIES}
    for family, path in dirs.items():
        _write_hf_model(family, path)
    return dirs


def _hf_logits(path: Path) -> torch.Tensor:
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


def _megatron(hf_dirs: dict[str, str], parallel: ParallelConfig) -> dict:
    """Per family: full logits (on the last stage), and whether each exported tensor equals the file's: streamed
    (export_hf_weights) and written in place by every rank (write_hf_weights into zeros, summed over the ranks: a
    share written twice or by no rank shows)."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.bridge.weights import build_export_plan, export_hf_weights, load_hf_weights, write_hf_weights
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.models.pipeline import run_pipeline
    from rlhf_mc.runtime import init_parallel

    init_parallel(parallel)
    results = {}
    for family, path in hf_dirs.items():
        model = model_config_from_hf(read_hf_config(path))
        chunks = build_model(model, parallel)
        load_hf_weights(chunks, path, model)
        for chunk in chunks:
            chunk.eval()
        batch = {"tokens": TOKENS, "position_ids": torch.arange(TOKENS.size(1)).expand_as(TOKENS)}

        def gather(mb, logits):
            parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
            torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            return torch.zeros(()), {"logits": torch.cat(parts, dim=-1)}

        with torch.no_grad():
            reports = run_pipeline(chunks, [batch], gather, forward_only=True)
        ckpt = HFCheckpoint(path)
        exported = {}
        plan = build_export_plan(chunks, model, bucket_bytes=40_000)
        for bucket in export_hf_weights(chunks, plan, model):
            for name, tensor in bucket:
                exported[name] = torch.equal(tensor, ckpt.read(name))
        written, outs = {}, [{name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in shapes}
                             for shapes in plan.hf_shapes]
        for b in write_hf_weights(chunks, plan, model, outs.__getitem__):
            for name, tensor in outs[b].items():
                torch.distributed.all_reduce(tensor)
                written[name] = torch.equal(tensor, ckpt.read(name))
        results[family] = {"logits": reports[0]["logits"] if reports else None, "exported": exported,
                           "written": written,
                           "buckets": len(plan.buckets), "names": ckpt.names()}
    return results


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_megatron_equals_transformers(hf_models, tp, pp):
    _check_megatron({f: p for f, p in hf_models.items() if tp == 1 or f not in TP1_ONLY},
                    ParallelConfig(tp=tp, pp=pp))


@pytest.mark.parametrize("tp, ep, pp", [(2, 2, 1), (1, 2, 2)])
def test_expert_parallel_equals_transformers(hf_models, tp, ep, pp):
    """Each EP rank loads only its experts (and exports gather them); at pp=2 ep=2 takes two data-parallel ranks a
    stage."""
    _check_megatron({f: hf_models[f] for f in MOE if tp == 1 or f not in TP1_ONLY},
                    ParallelConfig(tp=tp, pp=pp, ep=ep))


def _check_megatron(hf_models: dict[str, Path], parallel: ParallelConfig) -> None:
    results = spawn(_megatron, parallel.min_world_size, {f: str(p) for f, p in hf_models.items()}, parallel)
    for family, path in hf_models.items():
        expected = _hf_logits(path)
        logits = [r[family]["logits"] for r in results if r[family]["logits"] is not None]
        assert logits, "no rank returned logits"
        for got in logits:
            assert (got - expected).abs().max().item() < 1e-4, family
        for r in results:
            exported = r[family]["exported"]
            assert sorted(exported) == r[family]["names"], f"{family}: exported names differ from the checkpoint's"
            assert all(exported.values()), f"{family}: not bitwise: {[n for n, ok in exported.items() if not ok]}"
            written = r[family]["written"]
            assert sorted(written) == r[family]["names"], f"{family}: written names differ from the checkpoint's"
            assert all(written.values()), f"{family}: written not bitwise: {[n for n, ok in written.items() if not ok]}"
            assert r[family]["buckets"] > 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)


def _error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def _roundtrip(hf: Path, tmp_path: Path, *layout: str) -> Path:
    """hf -> mcore at `layout` (CLI flags) -> hf loaded at TP=1 (and EP=1): every tensor bitwise, the config and
    tokenizer files passed through; returns the Megatron checkpoint."""
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    convert = str(ROOT / "tools" / "convert_checkpoint.py")
    result = _cli(convert, "hf-to-mcore", "--hf", str(hf), "--out", str(mcore), *layout, "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "mcore.tmp").exists()
    result = _cli(convert, "mcore-to-hf", "--ckpt", str(mcore), "--out", str(back), "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    original, converted = HFCheckpoint(hf), HFCheckpoint(back)
    assert converted.names() == original.names()
    for name in original.names():
        a, b = original.read(name), converted.read(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert json.loads((back / "config.json").read_text()) == read_hf_config(hf)
    assert (back / "tokenizer_config.json").read_text() == (hf / "tokenizer_config.json").read_text()
    return mcore


def test_convert_roundtrip_is_bitwise_and_score_matches_transformers(hf_models, tmp_path):
    hf = hf_models["qwen3"]
    mcore = _roundtrip(hf, tmp_path, "--tp", "2", "--pp", "2")

    sequences = tmp_path / "seqs.jsonl"
    sequences.write_text("".join(json.dumps(seq) + "\n" for seq in TOKENS.tolist()) + '{"tokens": [5, 9]}\n')
    scores = tmp_path / "scores.jsonl"
    result = _cli(str(ROOT / "tools" / "score.py"), "--ckpt", str(mcore), "--input", str(sequences),
                  "--out", str(scores), "--tp", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    got = [json.loads(line)["logprobs"] for line in scores.read_text().splitlines()]
    expected = torch.log_softmax(_hf_logits(hf), -1)[:, :-1].gather(-1, TOKENS[:, 1:, None])[..., 0]
    assert len(got) == 3 and len(got[2]) == 1
    assert (torch.tensor(got[:2]) - expected).abs().max().item() < 1e-4


def test_convert_roundtrip_at_expert_parallel_is_bitwise(hf_models, tmp_path):
    """Qwen3-MoE: HF -> Megatron at TP=2 x EP=2 (each rank saves its experts) -> HF at TP=1 x EP=1."""
    hf = hf_models["qwen3_moe"]
    assert any(".mlp.experts.3.down_proj." in name for name in HFCheckpoint(hf).names())
    mcore = _roundtrip(hf, tmp_path, "--tp", "2", "--ep", "2")
    assert json.loads((mcore / "rlhf_mc.json").read_text())["saved_with"]["ep"] == 2
    # scored at EP=2 (two ranks, two experts each): transformers' log-probs
    sequences, scores = tmp_path / "seqs.jsonl", tmp_path / "scores.jsonl"
    sequences.write_text("".join(json.dumps(seq) + "\n" for seq in TOKENS.tolist()))
    result = _cli(str(ROOT / "tools" / "score.py"), "--ckpt", str(mcore), "--input", str(sequences),
                  "--out", str(scores), "--ep", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    got = torch.tensor([json.loads(line)["logprobs"] for line in scores.read_text().splitlines()])
    expected = torch.log_softmax(_hf_logits(hf), -1)[:, :-1].gather(-1, TOKENS[:, 1:, None])[..., 0]
    assert (got - expected).abs().max().item() < 1e-4
    convert = str(ROOT / "tools" / "convert_checkpoint.py")
    line = _error_line(_cli(convert, "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "x"), "--ep", "3"))
    assert "ep: 3 does not divide model.num_experts=4" in line


def test_conversion_errors_are_one_line(hf_models, tmp_path):
    convert = str(ROOT / "tools" / "convert_checkpoint.py")
    hf = hf_models["llama"]

    line = _error_line(_cli(convert, "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "a"),
                            "--model-config", str(ROOT / "model_configs" / "tiny-qwen3.yaml")))
    assert "family: model config has 'qwen3' but the HF checkpoint's config.json has 'llama'" in line

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    line = _error_line(_cli(convert, "hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "b")))
    assert f"missing shard file {shard}" in line

    config = read_hf_config(hf)
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    line = _error_line(_cli(convert, "hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "c")))
    assert "architectures: ['GPT2LMHeadModel'] is not supported" in line

    # a shard cut short (a download or copy that stopped): named with the reason before any rank starts
    for f in hf.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    line = _error_line(_cli(convert, "hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "c")))
    assert line == (f"error: {shard}: not a complete safetensors file (Error while deserializing header: incomplete "
                    "metadata, file not fully covered)")

    line = _error_line(_cli(convert, "hf-to-mcore", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "d")))
    assert line == f"error: {tmp_path / 'nowhere'}: no such directory"
    line = _error_line(_cli(convert, "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "e"), "--tp", "3"))
    assert "tp: 3 does not divide model.num_attention_heads=4" in line
    assert not any(p.name in "abcde" for p in tmp_path.iterdir())


def test_moe_config_translation(hf_models):
    """Qwen3-MoE, GLM-4.5 and DeepSeek-V3 config.json -> ModelConfig and back; published Qwen3-MoE configs say
    num_experts, transformers 5 writes num_local_experts; what Megatron would route differently is refused, naming
    the field."""
    from rlhf_mc.bridge.hf_config import hf_config_from_model
    from rlhf_mc.config import ConfigError

    hf = read_hf_config(hf_models["qwen3_moe"])
    model = model_config_from_hf(hf)
    assert (model.family, model.num_experts, model.moe_topk, model.moe_ffn_hidden_size, model.moe_norm_topk_prob,
            model.qk_norm, model.moe_dense_layers) == ("qwen3_moe", 4, 2, 32, True, True, (2,))
    published = {k: v for k, v in hf.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert model_config_from_hf(published) == model == model_config_from_hf(hf_config_from_model(model))
    # transformers' rule: layer i is MoE unless listed in mlp_only_layers or (i + 1) % decoder_sparse_step != 0; a
    # leading run of dense layers is DeepSeek's dense prefix (a number)
    for only, step, dense in (([], 1, 0), ([0, 1], 1, 2), ([], 2, (0, 2)), ([3], 2, (0, 2, 3)), ([1, 3], 1, (1, 3))):
        assert model_config_from_hf({**hf, "mlp_only_layers": only, "decoder_sparse_step": step}
                                    ).moe_dense_layers == dense, (only, step)
    with pytest.raises(ConfigError, match=re.escape("moe_dense_layers: 4 leaves no MoE layer of num_layers=4")):
        model_config_from_hf({**hf, "decoder_sparse_step": 5})

    glm = read_hf_config(hf_models["glm4_moe"])
    model = model_config_from_hf(glm)
    assert (model.family, model.num_experts, model.moe_router_score, model.moe_expert_bias, model.moe_groups,
            model.moe_group_topk, model.moe_routed_scaling, model.moe_shared_ffn_hidden_size, model.moe_dense_layers,
            model.rotary_percent, model.qkv_bias, model.qk_norm) == (
        "glm4_moe", 8, "sigmoid", True, 2, 1, 2.5, 32, 1, 0.5, True, True)
    assert model_config_from_hf(hf_config_from_model(model)) == model
    for change, message in (({"norm_topk_prob": False}, "norm_topk_prob: false is not supported"),
                            ({"topk_group": 2}, "topk_group: 2 with num_experts_per_tok=2 is not supported")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            model_config_from_hf({**glm, **change})

    deepseek = read_hf_config(hf_models["deepseek_v3"])
    model = model_config_from_hf(deepseek)
    assert (model.family, model.q_lora_rank, model.kv_lora_rank, model.head_dim, model.qk_rope_head_dim,
            model.v_head_dim, model.num_experts, model.moe_router_score) == (
        "deepseek_v3", 32, 32, 16, 8, 16, 8, "sigmoid")
    assert model_config_from_hf(hf_config_from_model(model)) == model
    for change, message in (({"rope_interleave": False}, "rope_interleave: false is not supported"),
                            ({"rms_norm_eps": 1e-5}, "rms_norm_eps: 1e-05 is not supported with multi-latent"),
                            ({"attention_bias": True}, "attention_bias: true is not supported")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            model_config_from_hf({**deepseek, **change})
