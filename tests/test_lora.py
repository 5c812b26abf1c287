"""LoRA on Megatron-Core (models/lora.py): against PEFT on the HF model (logits), TP / PP x VPP against one process
(loss, gradients and values of A and B after an Adam step, log-probs, checkpoints resharded), the base untouched,
the adapters off == the base model, PEFT directories in and out, and bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ConfigError, LoraConfig, ModelConfig, OptimizerConfig, ParallelConfig
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.runtime.spawn import spawn
from tests.conftest import ray_env, write_tiny_qwen2
from tests.test_sync import PROMPTS, _actor_logprobs, training_batch
from tests.test_train_step import LOSS, MODEL, OPTIM, STARTS, TOL, _data

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _random_adapter(model: ModelConfig, lora: LoraConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full PEFT tensors with B != 0 (PEFT starts B at zero, where A has no gradient)."""
    from rlhf_mc.models.lora import adapter_shapes

    g = torch.Generator().manual_seed(seed)
    return {name: 0.3 * torch.randn(shape, generator=g) for name, shape in adapter_shapes(model, lora).items()}


def _logits(chunks) -> torch.Tensor:
    """Full-vocabulary logits of TOKENS (TP shards gathered); one pipeline stage."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        logits = chunks[0](TOKENS, torch.arange(TOKENS.size(1)).expand_as(TOKENS), None)
    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _against_peft(hf_dir: str, adapter_dir: str, parallel: ParallelConfig, out_dir: str) -> dict:
    from rlhf_mc.bridge.adapters import read_peft_adapter, write_peft_adapter
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models import lora
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    init_parallel(parallel)
    model = model_config_from_hf(read_hf_config(hf_dir))
    base, chunks = build_model(model, parallel), build_model(model, parallel)
    for c in (base, chunks):
        load_hf_weights(c, hf_dir, model)
    lora.attach(chunks, model, LORA, seed=3)
    zero_b = _logits(chunks)
    lora.load_full(chunks, read_peft_adapter(adapter_dir, LORA, model))
    with lora.adapters_off(chunks):
        off = _logits(chunks)
    full = lora.full_tensors(chunks)
    if torch.distributed.get_rank() == 0:
        write_peft_adapter(out_dir, full, LORA, hf_dir)
    return {"base": _logits(base), "zero_b": zero_b, "on": _logits(chunks), "off": off,
            "trainable": sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad), "full": full}


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_equal_peft_and_start_as_the_base(tmp_path, tp):
    """Our Megatron model with a PEFT adapter loaded gives PEFT's logits on the HF model; a fresh adapter (B = 0)
    gives the base's bit for bit, and so do the adapters switched off (the reference) against a separate base model;
    the adapter we write back is PEFT's, tensor for tensor, and loads in peft."""
    import peft
    import transformers as T
    from safetensors.torch import load_file

    hf_dir = write_tiny_qwen2(tmp_path / "base")
    hf = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, init_lora_weights=False,
                                                         target_modules=list(LORA.targets)))
    peft_model.save_pretrained(tmp_path / "adapter")
    results = spawn(_against_peft, tp, str(hf_dir), str(tmp_path / "adapter"), ParallelConfig(tp=tp),
                    str(tmp_path / "ours"))
    with torch.no_grad():
        expected = peft_model(TOKENS).logits
    for r in results:
        assert torch.equal(r["zero_b"], r["base"]) and torch.equal(r["off"], r["base"])
        assert (r["on"] - expected).abs().max().item() < 1e-4
        assert (r["on"] - r["base"]).abs().max().item() > 1  # the adapter does something
        assert r["trainable"] * tp >= sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(results[0]["full"]) == sorted(saved)
    assert all(torch.equal(results[0]["full"][k], saved[k]) for k in saved)
    reloaded = peft.PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                              tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, expected)


def _lora_step(parallel: ParallelConfig, ckpt: str, reference: bool) -> dict:
    from megatron.core import parallel_state as ps

    from rlhf_mc.models import lora
    from rlhf_mc.models.checkpoint import load_model, save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob
    from rlhf_mc.workers.train import train_step

    init_parallel(parallel, seed=11)
    chunks = build_model(MODEL, parallel)
    lora.attach(chunks, MODEL, LORA, seed=5)
    if reference:
        lora.load_full(chunks, _random_adapter(MODEL, LORA))
        save_model(chunks, Path(ckpt) / "lora0")
    else:  # the base and the adapters resharded from the single process's checkpoint
        load_model(chunks, Path(ckpt) / "lora0")
    frozen = [(p, p.detach().clone()) for c in chunks for p in c.parameters() if not p.requires_grad]
    state = setup_training(chunks, dataclasses.replace(OPTIM, use_distributed_optimizer=False))
    seqs, per_token = _data()
    batch = Trajectories.single_turn(seqs, STARTS, per_token)
    metrics = train_step(state, batch, LOSS, temperature=0.9, micro_batch_tokens=40)
    in_optimizer = sum(p.numel() for g in state.optimizer.param_groups for p in g["params"])
    return {"metrics": metrics, "grads": lora.full_tensors(chunks, of=lambda p: p.main_grad),
            "after": lora.full_tensors(chunks), "base_change": max((p - p0).abs().max().item() for p, p0 in frozen),
            "in_optimizer": in_optimizer, "dp": ps.get_data_parallel_world_size(),
            "logprobs": compute_log_prob(chunks, batch, 0.9, micro_batch_tokens=40)["logprobs"]}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("lora_ref")
    (result,) = spawn(_lora_step, 1, ParallelConfig(), str(ckpt), True)
    return str(ckpt), result


@pytest.mark.parametrize("name, parallel", [("tp2", ParallelConfig(tp=2)), ("pp2_vpp2", ParallelConfig(pp=2, vpp=2))])
def test_lora_step_matches_single_process(single_process, name, parallel):
    ckpt, expected = single_process
    adapter_numel = sum(t.numel() for t in expected["after"].values())
    assert expected["in_optimizer"] == adapter_numel  # the base is not in the optimizer
    assert expected["base_change"] == 0
    assert all(g.abs().max() > 0 for g in expected["grads"].values())  # A and B get gradients
    results = spawn(_lora_step, parallel.min_world_size, parallel, ckpt, False)
    rank0 = results[0]
    assert sorted(rank0["grads"]) == sorted(expected["grads"])
    for key in expected["grads"]:
        assert (rank0["grads"][key] - expected["grads"][key]).abs().max().item() < TOL, f"{name}: grad of {key}"
        assert (rank0["after"][key] - expected["after"][key]).abs().max().item() < TOL, f"{name}: {key} after"
    for r in results:
        assert r["base_change"] == 0
        assert abs(r["metrics"]["grad_norm"] - expected["metrics"]["grad_norm"]) < TOL, name
        if "pg_loss" in r["metrics"]:
            for key in ("pg_loss", "kl_loss", "entropy"):
                assert abs(r["metrics"][key] - expected["metrics"][key]) < TOL, f"{name}: {key}"
        assert (r["logprobs"] - expected["logprobs"]).abs().max().item() < TOL, f"{name}: log-probs after the step"


# ------------------------------------------------------------ bad input: one line, the field and the value

def test_lora_fields_are_checked():
    from rlhf_mc.models.lora import check_lora

    with pytest.raises(ConfigError, match=r"^target_modules: 'qkv_proj' matches no linear layer"):
        LoraConfig(enabled=True, target_modules=("q_proj", "qkv_proj"))
    with pytest.raises(ConfigError, match=r"^rank: 16 is read only with lora.enabled=true"):
        LoraConfig(rank=16)
    with pytest.raises(ConfigError, match=r"^dropout: must lie in \[0, 1\), got 1.5"):
        LoraConfig(enabled=True, dropout=1.5)
    # tiny-llama: 2 kv heads x 16 = 32 outputs of k_proj
    with pytest.raises(ConfigError, match=r"^actor.lora.rank: 33 exceeds the width of k_proj \(32"):
        check_lora(LoraConfig(enabled=True, rank=33), MODEL, use_te=False)
    check_lora(LoraConfig(enabled=True, rank=32), MODEL, use_te=False)
    with pytest.raises(ConfigError, match=r"^actor.lora.enabled: LoRA runs on the local layer spec only"):
        check_lora(LORA, MODEL, use_te=True)


def test_adapter_of_another_base_is_refused(tmp_path):
    import peft
    import transformers as T

    from rlhf_mc.bridge.adapters import read_peft_adapter
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config

    ours = model_config_from_hf(read_hf_config(write_tiny_qwen2(tmp_path / "ours")))
    other = T.Qwen2ForCausalLM(T.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    peft.get_peft_model(other, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA.targets))
                        ).save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"^actor.lora.adapter_path: .*\.(\w+)\.lora_A\.weight has shape \[4, (32|64)\], "
                                          r"this model's \1 needs \[4, (64|128)\]: another base model\?$"):
        read_peft_adapter(tmp_path / "other", LORA, ours)
    with pytest.raises(ConfigError, match=r"^actor.lora.rank: 8, but the adapter at .* has 4: set it to match$"):
        read_peft_adapter(tmp_path / "other", LoraConfig(enabled=True), ours)
    with pytest.raises(ConfigError, match=r"^actor.lora.adapter_path: .* is not a PEFT adapter directory"):
        read_peft_adapter(tmp_path / "ours", LORA, ours)


# ------------------------------------------------------------ sync into SGLang: the adapter, or the adapted layers

def _synced_actor(model_dir: str, address: str, transport: str, parallel: ParallelConfig) -> dict:
    """A LoRA actor (adapter from _random_adapter) trains two steps; after each, a sync to the engine at
    `address`, then the engine's greedy samples and their log-probs against the actor's."""
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.config import PolicyLossConfig, RolloutConfig
    from rlhf_mc.models import lora
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.rollout.base import SamplingParams
    from rlhf_mc.rollout.sglang_engine import SGLangEngine
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.sync.transports import connect
    from rlhf_mc.sync.weights import WeightSync, check_versions
    from rlhf_mc.workers.train import train_step

    init_parallel(parallel, seed=3)
    model = model_config_from_hf(read_hf_config(model_dir))
    chunks = build_model(model, parallel)
    load_hf_weights(chunks, model_dir, model)
    lora.attach(chunks, model, LORA, seed=1)
    lora.load_full(chunks, _random_adapter(model, LORA, seed=1))
    state = setup_training(chunks, OptimizerConfig(lr=2e-2, weight_decay=0.0))
    sync = WeightSync(chunks, model, connect(transport, [address], [list(range(parallel.tp))], config_from=model_dir,
                                             adapter=LORA), bucket_bytes=20_000, adapted_only=transport != "adapter")
    client = SGLangEngine(RolloutConfig(addresses=(address,), lora_adapter="" if transport != "adapter" else "served"))
    steps = []
    for version in (1, 2):
        stats = sync.sync(chunks, version)
        box = [None]
        if torch.distributed.get_rank() == 0:
            samples = client.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
            check_versions([v for s in samples for v in s.versions], version)
            box = [[(s.response_ids, s.logprobs) for s in samples]]
        torch.distributed.broadcast_object_list(box, src=0)
        actor = _actor_logprobs(chunks, [r for r, _ in box[0]])
        steps.append({"diff": max((torch.tensor(lp) - a).abs().max().item() for (_, lp), a in zip(box[0], actor)),
                      "greedy": [r for r, _ in box[0]], "stats": stats})
        train_step(state, training_batch(model.vocab_size), PolicyLossConfig(), micro_batch_tokens=64)
    return {"steps": steps, "transport": type(sync.transport).__name__,
            "plan_bytes": None if sync.plan is None else sync.plan.total_bytes}


@pytest.fixture(scope="module")
def lora_engine(tiny_hf_model, tmp_path_factory):
    """An engine serving the tiny model with LoRA on (as the trainer launches it: a zero adapter to start)."""
    from rlhf_mc.bridge.adapters import write_peft_adapter
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.models.lora import zero_adapter
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    model = model_config_from_hf(read_hf_config(tiny_hf_model))
    adapter = tmp_path_factory.mktemp("engine_adapter") / "adapter"
    write_peft_adapter(adapter, zero_adapter(model, LORA), LORA, str(tiny_hf_model))
    engine = SGLangEngine(RolloutConfig(model_path=str(tiny_hf_model), dtype="float32", lora_adapter=str(adapter)),
                          log_dir=tmp_path_factory.mktemp("lora_engine_logs"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("transport", ["adapter", "tensor"])
def test_engine_follows_the_lora_actor(transport, request, tiny_hf_model):
    """After each sync the engine's log-probs of its greedy samples equal the TP=2 actor's: the adapter served by
    SGLang's LoRA (replaced at each sync, the base untouched), or the adapted layers merged (the rest left as the
    engine holds it)."""
    from rlhf_mc.rollout.sglang_engine import LAUNCH_VERSION

    engine = request.getfixturevalue("lora_engine" if transport == "adapter" else "sglang_engine")
    address = engine.urls[0].removeprefix("http://")
    try:
        first = spawn(_synced_actor, 2, str(tiny_hf_model), address, transport, ParallelConfig(tp=2))[0]
    finally:
        if transport != "adapter":  # the shared engine goes back to the checkpoint's weights
            engine.update_weights_from_disk(str(tiny_hf_model), version=LAUNCH_VERSION)
    for step in first["steps"]:
        assert step["diff"] < 1e-4 and not step["stats"].failed
    assert first["steps"][0]["greedy"] != first["steps"][1]["greedy"], "the update did not reach the engine"
    # the tiny model: 2 layers, hidden 64, q 64, k/v 32, MLP 128 wide; rank 4 on the 7 modules
    stats = first["steps"][0]["stats"]
    if transport == "adapter":  # A and B of each module: 4 x 1024 parameters a layer
        assert first["transport"] == "AdapterTensors"
        assert (stats.bytes, stats.tensors, stats.buckets) == (2 * 4 * 1024 * 4, 2 * 2 * 7, 1)
    else:  # the adapted base weights only (not the embeddings, the head, the norms or the qkv bias)
        assert first["transport"] == "SharedStaging"
        assert stats.bytes == first["plan_bytes"] == 2 * (3 * 64 * 64 + 3 * 128 * 64) * 4


def test_recipe_refuses_what_lora_does_not_do(tiny_hf_model):
    from rlhf_mc.trainer.placement import check_private
    from rlhf_mc.trainer.plan import make_plan
    from rlhf_mc.trainer.recipe import REPO, load_recipe, model_config

    quickstart = REPO / "recipes/quickstart.yaml"
    lora_on = ["actor.lora.enabled=true", "sft.data_path=", f"model.path={tiny_hf_model}"]  # from HF weights

    def plan(*overrides: str, cuda: bool = False):
        recipe = load_recipe(quickstart, [*lora_on, *overrides])
        return make_plan(recipe, model_config(recipe), cuda=cuda)

    assert plan().sync_transport == "tensor"  # on CPU auto is merged: the adapted layers through the tensor transport
    assert plan("actor.lora.sync=adapter").sync_transport == "adapter"
    assert plan(cuda=True).sync_transport == "adapter"
    assert plan("model.path=", cuda=True).sync_transport == "tensor"  # random init: the engines start on placeholders
    cases = {
        ("actor.lora.rank=0",): r"^actor\.lora\.rank: must be >= 1, got 0$",
        ("critic.lora.enabled=true",): r"^critic\.lora: LoRA adapts the actor",
        ("ref.placement=separate", "actor.loss.kl_loss_coef=0.1"): r"^ref\.placement: separate, with actor\.lora on",
        ("rollout.engine.lora_adapter=/tmp/x",): r"^rollout\.engine\.lora_adapter: set by the trainer",
        ("rollout.sync_transport=disk", "actor.lora.sync=adapter"):
            r"^rollout\.sync_transport: disk with actor\.lora\.sync=adapter: the adapter goes by its own transport",
        ("actor.lora.sync=adapter", "rollout.engine={addresses: ['127.0.0.1:30000'], num_engines: 1}",
         "rollout.placement=disaggregated"): r"^actor\.lora\.sync: adapter needs engines the trainer launches",
        ("actor.lora.sync=adapter", "model.path="): r"^actor\.lora\.sync: adapter needs model\.path and no SFT stage",
    }
    for overrides, error in cases.items():
        with pytest.raises(ConfigError, match=error):
            plan(*overrides)
    for host in ("127.0.0.1", "10.1.2.3", "192.168.0.7"):
        check_private(host)
    with pytest.raises(ConfigError, match=r"^actor\.lora\.allow_remote_engines: the engines would serve LoRA "
                                          r"adapters on 8\.8\.8\.8, a public address"):
        check_private("8.8.8.8")


@pytest.mark.slow
def test_lora_run_end_to_end(ray_address, tmp_path):
    """tools/launch.py with actor.lora: the engine serves the adapter and follows the actor at every sync (the
    adapter's bytes alone), the reference is the base (KL 0 while B = 0, then not), and the run's PEFT adapter on
    the HF base gives the logits of its merged export in plain transformers and peft."""
    import json
    import subprocess
    import sys

    import peft
    import transformers as T

    from rlhf_mc.bridge.hf_config import hf_config_from_model
    from tests.test_trainer import ONE_SLOT, REPO

    # the quickstart's model as an HF base (LoRA with the adapter served starts from HF weights)
    base_dir = tmp_path / "base"
    config = hf_config_from_model(ModelConfig.from_yaml(REPO / "model_configs/tiny-arith.yaml"))
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model(**config)).save_pretrained(base_dir)
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "tools/launch.py", "recipes/quickstart.yaml", "--address", ray_address,
         f"trainer.output_dir={out}", "sft.data_path=", "model.config=", f"model.path={base_dir}",
         "model.tokenizer=recipes/data/arith",
         "trainer.total_steps=2", *ONE_SLOT, "data.train_batch_size=8", "rollout.n=2", "data.val_path=",
         "actor.ppo_mini_batch_size=8", "actor.optim.lr=1e-2", "actor.optim.lr_warmup_steps=0",
         "actor.loss.kl_loss_coef=0.01", "trainer.loggers=[jsonl]", "reward.function=tests.test_trainer:char_codes",
         "actor.lora.enabled=true", "actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.sync=adapter",
         "actor.lora.export_merged=true"], cwd=REPO, env=ray_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["rollout/logprob_diff"] < 1e-4 and s["sync/failed_engines"] == 0
    # step 1: the actor is the base (B = 0), so the KL is fp32 noise of two forward passes packed differently (0 here,
    # 1.3e-8 on CI's machine); step 2's is the first update's
    assert steps[0]["actor/kl_ref"] == pytest.approx(0, abs=1e-6) and abs(steps[1]["actor/kl_ref"]) > 1e-6
    # tiny-arith: rank 4 on 7 modules of each layer, fp32
    h, layers, ffn = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    assert steps[0]["sync/bytes"] == 4 * layers * 4 * (2 * (q + h) + 2 * (kv + h) + 3 * (ffn + h))
    tokens = torch.randint(3, config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    base = T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out / "final_adapter")
    merged = T.AutoModelForCausalLM.from_pretrained(out / "final_hf", dtype=torch.float32)
    with torch.no_grad():
        expected, got = merged(tokens).logits, adapted(tokens).logits
        assert (got - expected).abs().max().item() < 1e-5
        with adapted.disable_adapter():
            assert (adapted(tokens).logits - expected).abs().max().item() > 1e-3  # the adapter moved
