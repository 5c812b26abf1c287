"""Recipes: every shipped recipe passes --dry-run; the plan's numbers match hand computation (DESIGN.md's example);
every malformed recipe fails before anything starts, with one line naming the field."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_mc.config import ConfigError, ModelConfig, OptimizerConfig, ParallelConfig
from rlhf_mc.trainer.plan import make_plan
from rlhf_mc.trainer.recipe import apply_overrides, load_recipe, model_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
QUICKSTART = REPO / "recipes/quickstart.yaml"


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools/launch.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def stand_ins(recipe_path: Path, tmp_path: Path) -> list[str]:
    """Overrides that point a GPU recipe's missing inputs (/models/..., data/...) at stand-ins: an HF directory
    with the config.json of the recipe's model.config and a (tiny) weights file, data files of the same format; the
    real model's recipes get it (tools/prepare_model.py, cached under runs/), and their teacher or judge too."""
    from safetensors.torch import save_file

    from rlhf_mc.bridge.hf_config import hf_config_from_model
    from rlhf_mc.trainer.recipe import PATHS

    recipe, overrides = load_recipe(recipe_path), []
    for section, fields in PATHS.items():
        for field in fields:
            value = getattr(getattr(recipe, section), field)
            if not value or Path(value).exists():
                continue
            stand_in = tmp_path / f"{section}_{field}{Path(value).suffix}"
            if section in ("teacher", "judge"):  # served models: the actor's own checkpoint (its tokenizer)
                model_path = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.path=")),
                                  recipe.model.path)
                overrides.append(f"{section}.{field}={model_path}")
                continue
            if section == "model" and not recipe.model.config:
                sys.path.insert(0, str(REPO / "tools"))
                from prepare_model import prepare, smollm2_gguf

                stand_in = prepare(smollm2_gguf(), Path(value))
            elif section == "model":
                stand_in.mkdir()
                (stand_in / "config.json").write_text(json.dumps(hf_config_from_model(model_config(recipe))))
                save_file({"x": torch.zeros(1)}, stand_in / "model.safetensors")
            elif stand_in.suffix == ".parquet":
                pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), stand_in)
            else:
                stand_in.write_text('{"prompt": "1+1=", "answer": "2"}\n')
            overrides.append(f"{section}.{field}={stand_in}")
    return overrides


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipes_dry_run(recipe, tmp_path):
    """Every check a launch runs before Ray (inputs present and readable, HF configs matching model.config), the
    plan and the placement; the GPU recipes' inputs are stand-ins."""
    import contextlib
    import io

    sys.path.insert(0, str(REPO / "tools"))
    from launch import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(recipe), "--dry-run", *stand_ins(recipe, tmp_path)]) == 0
    text = out.getvalue()
    assert "plan:" in text and "placement:" in text and "node 0 device 0: actor rank 0" in text


def test_dry_run_runs_the_launch_checks(tmp_path):
    """What the launch refuses before Ray, the dry run refuses too: a missing model.path, a data file of another
    format, an HF directory whose weights are cut short or whose architecture is not supported."""
    from rlhf_mc.bridge.hf_config import hf_config_from_model

    recipe = REPO / "recipes" / "grpo_qwen2.5_7b_gsm8k.yaml"
    overrides = stand_ins(recipe, tmp_path)
    model_dir = Path(next(o for o in overrides if o.startswith("model.path=")).split("=", 1)[1])
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\n")
    cases = [(["model.path=/nowhere/Qwen2.5-7B"], "error: model.path: not found: /nowhere/Qwen2.5-7B"),
             ([f"data.train_path={csv}"], f"error: data.train_path: {csv} is not a .jsonl or .json or .parquet file")]
    weights = model_dir / "model.safetensors"
    for case in ("truncated", "unsupported"):
        broken = tmp_path / case
        broken.mkdir()
        config = hf_config_from_model(model_config(load_recipe(recipe)))
        if case == "unsupported":
            config["architectures"] = ["GPT2LMHeadModel"]
            (broken / "model.safetensors").write_bytes(weights.read_bytes())
            reason = ("architectures: ['GPT2LMHeadModel'] is not supported (supported: "
                      "LlamaForCausalLM, Qwen2ForCausalLM")
        else:
            (broken / "model.safetensors").write_bytes(weights.read_bytes()[:-2])
            reason = f"{broken / 'model.safetensors'}: not a complete safetensors file"
        (broken / "config.json").write_text(json.dumps(config))
        cases.append(([f"model.path={broken}"], f"error: model.path: {broken}: {reason}"))
    for extra, message in cases:
        result = _launch(str(recipe), "--dry-run", *overrides, *extra)
        assert result.returncode == 2 and result.stderr.startswith(message), (extra, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1


def test_real_scale_plans():
    """The numbers the recipes promise: devices, layouts, placement."""
    def plan(name):
        recipe = load_recipe(REPO / "recipes" / name)
        return make_plan(recipe, model_config(recipe))

    ppo = plan("ppo_llama3.1_70b.yaml")
    assert (ppo.devices, ppo.actor_world, ppo.actor_dp, ppo.critic_world, ppo.rollout_devices) == (48, 32, 1, 32, 16)
    assert ppo.sync_transport == "distributed"
    assert ppo.placement[32]["roles"] == ["rollout engine 0 tp rank 0"] and ppo.placement[32]["node"] == 4
    long = plan("grpo_long_context_cp2.yaml")
    assert long.max_sequence_tokens == 32048 and long.actor_dp == 1 and long.context_length == 32768
    dapo = plan("dapo_qwen3_8b.yaml")
    assert (dapo.devices, dapo.actor_dp, dapo.sequences_per_step) == (16, 2, 512 * 16)
    # Colocated over two nodes: every engine is fed from its own node's trainer ranks (8 engines x TP=2).
    assert dapo.sync_transport == "tensor" and dapo.colocated
    assert dapo.engines == [(2 * e, 2) for e in range(8)] and dapo.placement[9]["node"] == 1


def test_memory_estimate_per_gpu_by_hand():
    """The 7B recipe on H100s (79.6 GiB, as torch reports them; tp=2, dp=4, bf16, distributed optimizer): per rank,
    bf16 weights of half the model, fp32 gradients of that half, Adam's two fp32 moments and the fp32 master copy
    sharded over 4 ranks; the engines' static memory, 0.6 of the GPU. With the actor offloaded while the engines
    generate it fits; kept on the GPU it does not, and the plan says so and what to set."""
    gib, gpu = 2**30, 79.6
    recipe = load_recipe(REPO / "recipes" / "grpo_qwen2.5_7b_gsm8k.yaml", [f"resources.gpu_memory_gib={gpu}"])
    model = model_config(recipe)
    assert model.num_parameters == 7_615_616_512  # Qwen2.5-7B-Instruct's safetensors index, summed
    half = model.num_parameters / 2
    estimate = make_plan(recipe, model, cuda=True).memory
    (actor,) = estimate.roles
    assert (actor.weights, actor.grads, actor.optimizer) == (half * 2, half * 4, half * 12 / 4) and actor.offloaded
    assert estimate.engine_static == 0.6 * gpu * gib and estimate.engine_weights == half * 2
    # keys and values of 2 of the 4 KV heads on each of the engine's 2 GPUs, 28 layers, head_dim 128, bf16
    assert estimate.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2
    assert (estimate.generating, estimate.training) == (0.6 * gpu * gib, half * 9)
    assert not any(line.startswith("WARNING") for line in make_plan(recipe, model, cuda=True).lines())
    kept = make_plan(load_recipe(REPO / "recipes" / "grpo_qwen2.5_7b_gsm8k.yaml",
                                 [f"resources.gpu_memory_gib={gpu}", "actor.offload=false"]), model, cuda=True)
    assert kept.memory.generating == half * 9 + 0.6 * gpu * gib  # 31.9 + 47.8 GiB
    assert kept.lines()[-1].startswith("WARNING: 79.7 GiB exceeds the 79.6 GiB GPU; set actor.offload=true")
    quickstart = load_recipe(QUICKSTART)  # on CPU the ranks and engines share host memory: no per-GPU estimate
    assert make_plan(quickstart, model_config(quickstart), cuda=False).memory is None


def _megatron_state_bytes(dtype: str) -> dict:
    """What a rank of the tiny Llama at DP=2 holds after a step: its weights, its fp32 main gradients, and the
    distributed optimizer's shard of Adam's moments and (16-bit models) fp32 master weights."""
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.train import sft_step

    model = ModelConfig.from_yaml(REPO / "model_configs" / "tiny-llama.yaml")
    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(model, ParallelConfig(), dtype=dtype)
    state = setup_training(chunks, OptimizerConfig(lr=1e-5))
    sft_step(state, Trajectories.single_turn([torch.randint(0, model.vocab_size, (16,)) for _ in range(2)], [8] * 2),
             64)
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = 0
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        optimizer += sum(size(v) for s in opt.optimizer.state.values() for v in s.values() if v.dim() > 0)
        if dtype == "bfloat16":  # fp32 masters copied from the bf16 weights (fp32 models' shards are views of them)
            optimizer += sum(size(p) for group in opt.optimizer.param_groups for p in group["params"])
    return {"weights": sum(size(p) for p in params), "grads": sum(size(p.main_grad) for p in params),
            "optimizer": optimizer}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_estimate_equals_megatrons_buffers(dtype):
    """The estimate of a trained role against the tensors Megatron allocated on each of two data-parallel ranks."""
    from rlhf_mc.runtime.spawn import spawn
    from rlhf_mc.trainer.memory import trained_role
    from rlhf_mc.trainer.recipe import TrainSection

    model = ModelConfig.from_yaml(REPO / "model_configs" / "tiny-llama.yaml")
    estimate = trained_role("actor", TrainSection(), model, dtype, 2)
    ranks = spawn(_megatron_state_bytes, 2, dtype)
    assert [(r["weights"], r["grads"]) for r in ranks] == [(estimate.weights, estimate.grads)] * 2
    assert sum(r["optimizer"] for r in ranks) == 2 * estimate.optimizer


@pytest.mark.parametrize("recipe", [r for r in RECIPES if load_recipe(r).resources.device == "cuda"],
                         ids=lambda r: r.stem)
def test_gpu_recipes_fit_h100s(recipe):
    """Every shipped GPU recipe's estimate (weights, gradients, optimizer, engine static memory) fits an 80 GB H100
    (79.6 GiB) in both phases of a step."""
    r = load_recipe(recipe, ["resources.gpu_memory_gib=79.6"])
    plan = make_plan(r, model_config(r), cuda=True)
    assert plan.memory.peak < 79.6 * 2**30, plan.memory.lines()


@pytest.mark.parametrize("cuda", [False, True])
def test_colocated_engines_release_their_memory_on_gpus_only(cuda):
    """Colocated engines give their memory back while the trainer works on GPUs (SGLang's memory saver); on CPU a
    release frees nothing, and the plan says the engines keep it."""
    recipe = load_recipe(QUICKSTART)
    plan = make_plan(recipe, model_config(recipe), cuda=cuda)
    assert plan.colocated and plan.engines_release_memory is cuda
    said = "colocated: engines release their memory while the trainer works"
    assert any(said in line for line in plan.lines()) is cuda


@pytest.mark.parametrize("tp, dp, per_rank", [(2, 3, 240), (1, 6, 120)])
def test_plan_normalizes_batch_sizes(tp, dp, per_rank):
    """DESIGN.md: 60 prompts x 12 samples = 720 sequences; 6 devices at TP=2 -> DP=3 -> 240 per rank per
    mini-batch (TP=1: DP=6 -> 120)."""
    recipe = load_recipe(QUICKSTART, ["data.train_batch_size=60", "rollout.n=12", "actor.ppo_mini_batch_size=60",
                                      "resources.devices_per_node=6", f"actor.parallel.tp={tp}"])
    plan = make_plan(recipe, model_config(recipe), cuda=False)
    assert (plan.sequences_per_step, plan.actor_dp, plan.sequences_per_mini_batch_per_rank) == (720, dp, per_rank)
    assert plan.mini_batches_per_step == 1 and plan.optimizer_steps_per_step == 1


@pytest.mark.parametrize("overrides, from_update", [
    ([], True),  # the whole batch in one mini-batch, one epoch: on-policy
    (["actor.ppo_mini_batch_size=4"], False),  # the second mini-batch's old policy is not the current one
    (["actor.ppo_epochs=2"], False),
    (["algorithm.kl_in_reward_coef=0.01"], False),  # the reward needs the old log-probs before the advantages
    (["algorithm.skip_on_policy_old_logprobs=false"], False),
    # one step off: the samples come from the weights before the ones trained
    (["rollout.mode=one_step_off", "rollout.placement=disaggregated", "resources.devices_per_node=3"], False),
    (["rollout.mode=async", "rollout.placement=disaggregated", "resources.devices_per_node=3"], False)])
def test_old_logprob_forward_is_skipped_only_on_policy(overrides, from_update):
    recipe = load_recipe(QUICKSTART, ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", *overrides])
    plan = make_plan(recipe, model_config(recipe), cuda=False)
    assert plan.old_logprobs_from_update is from_update
    assert ("old log-probs: the update's own (one on-policy optimizer step)" in plan.lines()) is from_update


def test_overrides_parse_yaml_values():
    data = apply_overrides({"actor": {"optim": {"lr": 1.0}}}, ["actor.optim.lr=1e-3", "trainer.loggers=[jsonl]",
                                                               "rollout.engine.tp=2"])
    assert data == {"actor": {"optim": {"lr": "1e-3"}}, "trainer": {"loggers": ["jsonl"]},
                    "rollout": {"engine": {"tp": 2}}}
    recipe = load_recipe(QUICKSTART, ["actor.optim.lr=1e-3"])
    assert recipe.actor.optim.lr == 1e-3  # YAML 1.1 reads "1e-3" as a string; the schema takes it as a float


TOOL_LOOP = ["rollout.function=rlhf_mc.rollout.multi_turn:tool_loop", "data.chat_template=true",
             "tools.functions=[rlhf_mc.tools.builtin:calculator]"]
ATTACHED = "rollout.engine.addresses=[127.0.0.1:1,127.0.0.1:2]"  # an address for each of the quickstart's engines
BAD = [
    (["actor.optim.lrr=1"], "actor.optim.lrr: unknown key"),
    (["actor.optim.lr=fast"], "actor.optim.lr: expected float, got str 'fast'"),
    (["actor.optim.lr=-1"], "lr: must be positive, got -1.0"),
    (["trainer.total_step=3"], "trainer.total_step: unknown key"),
    (["rollout.n"], "override 'rollout.n': expected key=value"),
    (["rollout.n=1"], "rollout.n: 1 with algorithm.estimator=grpo leaves every group without a baseline"),
    (["rollout.n=1", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1", "resources.devices_per_node=1",
      "rollout.engine.num_engines=1", "algorithm.estimator=gae"],
     "data.train_batch_size: 1 prompt(s) x rollout.n=1 = 1 sequence a step: algorithm.estimator=gae whitens"),
    (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size: 5 does not divide data.train_batch_size=32"),
    (["actor.ppo_mini_batch_size=1", "rollout.n=2", "resources.devices_per_node=4"],
     "actor.ppo_mini_batch_size: 1 prompts x rollout.n=2 = 2 sequences do not divide over actor data-parallel "
     "size 4"),
    (["actor.micro_batch_tokens=10"], "actor.micro_batch_tokens: 10 (x cp=1) cannot hold one sequence"),
    (["actor.parallel.tp=3", "resources.devices_per_node=3"], "tp: 3 does not divide model.num_attention_heads=4"),
    (["actor.parallel.tp=2", "resources.devices_per_node=3"], "parallel: world size 3 is not divisible by tp*pp*cp"),
    (["rollout.engine.context_length=10"], "rollout.engine.context_length: 10 is shorter than"),
    (["rollout.placement=disaggregated", "rollout.sync_transport=tensor", "resources.devices_per_node=3"],
     "rollout.sync_transport: tensor needs rollout.placement=colocated"),
    (["rollout.placement=disaggregated"],
     "rollout.placement: disaggregated, but num_engines*tp = 2 leaves no device of the 2"),
    (["resources.nodes=2", "resources.devices_per_node=3", "actor.parallel.tp=2", "rollout.n=3"],
     "actor.parallel.tp: 2 does not divide resources.devices_per_node=3: a tensor-parallel group must lie on one node"),
    (["resources.nodes=2", "resources.devices_per_node=3", "rollout.engine.tp=2", "rollout.engine.num_engines=3",
      "rollout.n=3"],
     "rollout.engine.tp: engine 1 (tp=2) would span devices 2-3 on two nodes of resources.devices_per_node=3"),
    ([ATTACHED, "rollout.engine.dtype=auto", "rollout.engine.extra_args=[]",
      "rollout.sync_transport=tensor"],
     "rollout.sync_transport: tensor needs engines the trainer launches on its own devices"),
    ([ATTACHED],
     "rollout.engine.dtype: 'float32' is what a server launched here starts with; the servers attached by addresses"),
    ([ATTACHED, "rollout.engine.dtype=auto", "rollout.engine.extra_args=[]",
      "rollout.engine.tp=2"], "rollout.engine.tp: 2 is what a server launched here starts with"),
    ([ATTACHED, "rollout.engine.dtype=auto", "rollout.engine.extra_args=[]",
      "rollout.engine.context_length=32"], "rollout.engine.context_length: 32 is what a server launched here starts"),
    ([ATTACHED, "rollout.engine.dtype=auto", "rollout.engine.extra_args=[]",
      "rollout.engine.deterministic=true"], "rollout.engine.deterministic: True is what a server launched here"),
    (["rollout.engine.model_path=/x"], "rollout.engine.model_path: set by the trainer"),
    (["rollout.engine.host=0.0.0.0"], "rollout.engine.host: '0.0.0.0': set by the trainer (127.0.0.1 on one node"),
    (["rollout.temperature=0.0", "rollout.engine.tpp=2"], "rollout.engine.tpp: unknown key"),
    (["algorithm.estimator=ppo"], "algorithm.estimator: 'ppo' is not one of"),
    (["actor.loss.dual_clip=0.5"], "actor.loss.dual_clip: must be > 1, got 0.5"),
    (["actor.loss.norm_length=100"],
     "actor.loss.norm_length: 100 is read by aggregation=seq-mean-token-sum-norm only, not token-mean"),
    (["actor.loss.kl_estimator=k2+", "actor.loss.kl_loss_coef=0.1"], "actor.loss.kl_estimator: 'k2+' is not one of"),
    (["actor.loss.tis_level=sequence"], "actor.loss.tis_level: sequence is read only with tis_cap set"),
    (["actor.loss.reject=token", "actor.loss.reject_low=1.5"],
     "actor.loss.reject_low, reject_high: need 0 < low < 1 < high, got 1.5, 2.0"),
    (["actor.loss.reject_high=3"], "actor.loss.reject_low, reject_high: 0.5, 3.0 are read only with reject set"),
    (["critic.loss.clip_low=0.1"], "critic.loss: the critic's loss is the clipped value loss"),
    (["actor.value_clip=0.5"], "actor.value_clip: 0.5 is the critic's (critic.value_clip)"),
    (["algorithm.kl_target=0.1"], "algorithm.kl_target: the adaptive KL controller needs kl_target > 0 and a "
                                  "starting kl_in_reward_coef > 0"),
    (["reward.overlong_buffer=6"], "reward.overlong_buffer: 6 must be below data.max_response_length=6"),
    (["ref.offload=true"], "ref.offload: the host reference lives in host memory already"),
    (["model.config=model_configs/none.yaml"], "model.config: file not found"),
    (["data.max_response_length=100"], "exceed the model's max_position_embeddings=64"),
    (["reward.function=no_such"], "reward.function: 'no_such' is neither a built-in"),
    (["reward.function=json:no_such_fn"], "reward.function: cannot import 'json:no_such_fn'"),
    (["data.train_path=/nonexistent.jsonl"], "data.train_path: not found: /nonexistent.jsonl"),
    (["trainer.resume=/nonexistent"], "trainer.resume: '/nonexistent' is not a complete checkpoint"),
    # every value range-checked at load
    (["rollout.top_p=1.5"], "rollout.top_p: must lie in (0, 1], got 1.5"),
    (["rollout.top_k=0"], "rollout.top_k: must be -1 (the whole vocabulary) or >= 1, got 0"),
    (["rollout.val_temperature=-1"], "rollout.val_temperature: must be >= 0, got -1"),
    (["actor.loss.clip_low=0"], "actor.loss.clip_low, clip_high: must be > 0, got 0"),
    (["actor.loss.entropy_coef=-0.1"], "actor.loss.entropy_coef: must be >= 0, got -0.1"),
    (["critic.value_clip=0"], "critic.value_clip: must be > 0, got 0"),
    (["algorithm.gamma=1.5"], "algorithm.gamma: must lie in [0, 1], got 1.5"),
    (["algorithm.kl_in_reward_coef=-1"], "algorithm.kl_in_reward_coef: must be >= 0, got -1"),
    (["reward.timeout_s=0"], "reward.timeout_s: must be > 0, got 0"),
    (["reward.workers=0"], "reward.workers: must be >= 1, got 0"),
    (["sft.batch_size=0"], "sft.batch_size: must be >= 1, got 0"),
    (["trainer.val_interval=-1"], "trainer.val_interval: must be >= 0, got -1"),
    (["resources.nodes=0"], "resources.nodes: must be >= 1, got 0"),
    (["data.val_size=-1"], "data.val_size: must be >= 0, got -1"),
    (["rollout.function=tests.nothing:here"], "rollout.function: cannot import 'tests.nothing:here'"),
    (["algorithm.dynamic_sampling_max_rounds=2", "rollout.n=2", "algorithm.group_filter=json"],
     "algorithm.group_filter: 'json' is not 'package.module:function'"),
    (["rollout.mode=one_step_off"], "rollout.mode: one_step_off generates while the actor trains: the engines need "
                                     "devices of their own"),
    (["rollout.mode=lazy"], "rollout.mode: 'lazy' is not one of"),
    (["rollout.mode=async"], "rollout.mode: async generates while the actor trains: the engines need devices"),
    (["rollout.max_staleness=2"], "rollout.max_staleness: 2 is read in async mode only (mode=sync: 0 by definition)"),
    (["rollout.mode=async", "rollout.max_staleness=-1"], "rollout.max_staleness: must be >= 0, got -1"),
    (["rollout.mode=async", "rollout.max_staleness=one"], "rollout.max_staleness:"),
    (["rollout.mode=async", "algorithm.dynamic_sampling_max_rounds=2"],
     "algorithm.dynamic_sampling_max_rounds: 2 with rollout.mode=async: the stream admits a fixed number of groups"),
    # multi-turn rollouts with tools
    (["tools.max_turns=2"], "tools: settings given but no tools.functions"),
    (["tools.functions=[rlhf_mc.tools.builtin:calculator]"],
     "tools.functions: tool calls and results are chat messages; set data.chat_template=true"),
    (["tools.functions=[rlhf_mc.tools.builtin:calculator]", "tools.timeout_s=0"], "tools.timeout_s: must be > 0"),
    (["tools.functions=[rlhf_mc.tools.builtin:calculator]", "data.chat_template=true", "rollout.ignore_eos=true",
      "rollout.function=rlhf_mc.rollout.multi_turn:tool_loop"],
     "rollout.ignore_eos: a multi-turn rollout's turns end at EOS"),
    (["sft.messages_key=messages"], "sft.messages_key: 'messages': conversations are tokenized through the chat"),
    (["tools.functions=[rlhf_mc.tools.builtin:calculator]", "data.chat_template=true"],
     "tools.functions: rollout.function 'rlhf_mc.rollout.functions:single_turn' takes no tools"),
    (["rollout.function=rlhf_mc.rollout.multi_turn:tool_loop"],
     "rollout.function: 'rlhf_mc.rollout.multi_turn:tool_loop' calls tools; list them in tools.functions"),
    (["rollout.function_kwargs={turns: 3}"],
     "rollout.function_kwargs: 'rlhf_mc.rollout.functions:single_turn' does not take them"),
    ([*TOOL_LOOP, "tools.functions=[rlhf_mc.tools.builtin:nothing]"], "tools.functions: cannot import"),
    ([*TOOL_LOOP, "tools.parser=xml"], "tools.parser: 'xml' is neither a built-in"),
    (TOOL_LOOP, "data.chat_template: the tokenizer has no chat template"),
    # mixture of experts
    (["actor.parallel.ep=2", "resources.devices_per_node=2"],
     "actor.parallel.ep: 2 needs a mixture-of-experts model; tiny-arith is dense"),
    (["actor.router.aux_loss_coef=0.01"], "actor.router: the router losses are read only for mixture-of-experts"),
    (["actor.router.z_loss_coef=-1"], "actor.router.z_loss_coef: must be >= 0, got -1"),
    (["model.config=model_configs/tiny-arith-moe.yaml", "actor.parallel.tp=2", "resources.devices_per_node=2"],
     "actor.parallel.tp: 2 with a mixture-of-experts model: Megatron trains MoE with TP only with sequence "
     "parallelism"),
    (["model.config=model_configs/tiny-arith-moe.yaml", "actor.parallel.ep=3", "resources.devices_per_node=3",
      "rollout.n=3"], "actor.parallel.ep: 3 does not divide model.num_experts=4"),
    (["model.config=model_configs/tiny-arith-moe.yaml", "actor.router.replay=true", "actor.recompute=full"],
     "actor.router.replay: routing replay is the actor's, with recompute=none"),
    (["resources.gpu_memory_gib=-1"], "resources.gpu_memory_gib: must be >= 0, got -1"),
    (["rollout.engine.return_routed_experts=true"],
     "rollout.engine.return_routed_experts: set by the trainer for mixture-of-experts models"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_malformed_recipe_fails_before_start(overrides, message, tmp_path, capsys):
    """Exit code 2, one line naming the field, and nothing started (no output directory, no Ray session)."""
    import ray

    sys.path.insert(0, str(REPO / "tools"))
    from launch import main

    out = tmp_path / "run"
    assert main([str(QUICKSTART), f"trainer.output_dir={out}", *overrides]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists() and not ray.is_initialized()


def test_launch_cli_exit_code(tmp_path):
    """The same through the command line: exit status 2 and the one line on stderr."""
    result = _launch(str(QUICKSTART), f"trainer.output_dir={tmp_path / 'run'}", "actor.optim.lrr=1")
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: actor.optim.lrr: unknown key (known: betas, clip_grad, eps, lr, lr_decay_steps, lr_decay_style, "
        "lr_warmup_steps, min_lr, use_distributed_optimizer, weight_decay)")


def test_recipe_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {config: model_configs/tiny-arith.yaml, tokenizer: recipes/data/arith}\n")
    with pytest.raises(ConfigError, match="^data: required key is missing$"):
        load_recipe(bad)
    recipe = load_recipe(bad, ["data.max_prompt_length=8"])
    with pytest.raises(ConfigError, match=r"^data.train_path: required \(unless sft.only\)$"):
        make_plan(recipe, model_config(recipe))
    with pytest.raises(ConfigError, match="^sft.only: an SFT-only job needs sft.data_path$"):
        load_recipe(bad, ["data.max_prompt_length=8", "sft.only=true"])
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_recipe(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_recipe(tmp_path / "missing.yaml")
    # a syntax error: one line with the file, line and column (where YAML found it), no traceback
    bad.write_text("model:\n  config: model_configs/tiny-arith.yaml\n  tokenizer: [recipes/data/arith\ndata: {}\n")
    result = _launch(str(bad))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: {bad}:4:5: not valid YAML (expected ',' or ']', but got ':')"), result.stderr
    # a key given twice (a second actor: block), at any depth: refused with both lines, not the first dropped
    bad.write_text("actor:\n  optim: {lr: 1.0e-5}\ndata: {max_prompt_length: 8}\nactor:\n  micro_batch_tokens: 64\n")
    with pytest.raises(ConfigError, match=f"^{bad}:4: key 'actor' given twice \\(first at line 1\\): the second "
                                          "would replace the first$"):
        load_recipe(bad)
    bad.write_text("data:\n  max_prompt_length: 8\n  max_prompt_length: 9\n")
    with pytest.raises(ConfigError, match=f"^{bad}:3: key 'max_prompt_length' given twice \\(first at line 2\\)"):
        load_recipe(bad)


def test_a_cluster_short_of_devices_is_refused_at_once():
    """Ray would wait for GPUs that never come (600 s, then a bare timeout): the run is refused before it waits,
    with what it asked for and what the cluster has (ray.cluster_resources()' keys)."""
    from rlhf_mc.trainer.placement import check_cluster_holds

    check_cluster_holds(8, {"CPU": 1, "GPU": 1}, {"CPU": 64.0, "GPU": 8.0, "memory": 1e12})
    with pytest.raises(ConfigError, match=r"^resources: the run asks for 16 devices \(16 GPU\), the Ray cluster has "
                                          r"8 GPU, 64 CPU$"):
        check_cluster_holds(16, {"CPU": 1, "GPU": 1}, {"CPU": 64.0, "GPU": 8.0})
    with pytest.raises(ConfigError, match=r"asks for 2 devices \(2 CPU\), the Ray cluster has 0 GPU, 1 CPU$"):
        check_cluster_holds(2, {"CPU": 1}, {"CPU": 1.0})


def test_slots_follow_node_ip_then_gpu_id_and_gpu_uuids_are_kept():
    """Hand-ordered: bundles by node IP (numerically: 10.0.0.9 before 10.0.0.10), then GPU id (numerically: 2
    before 10); Ray may give GPU ids as UUIDs (int() crashed on them), which sort after the numbers, and are passed
    on as they are. Workers that Ray leaves without CUDA_VISIBLE_DEVICES would all take GPU 0: refused."""
    from rlhf_mc.trainer.placement import check_visible_devices_set, order_slots

    found = [("b", "10.0.0.10", "0"), ("a", "10.0.0.9", "10"), ("a", "10.0.0.9", "2"),
             ("c", "10.0.0.11", "GPU-5e1a"), ("c", "10.0.0.11", "GPU-0b7c")]
    assert order_slots(found) == [2, 1, 0, 4, 3]
    assert order_slots([("a", "127.0.0.1", None), ("a", "127.0.0.1", None)]) == [0, 1]  # CPU slots: as placed
    check_visible_devices_set([None, "0", ""])
    with pytest.raises(ConfigError, match=r"^resources: the Ray workers have "
                                          r"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, so Ray does not set"):
        check_visible_devices_set([None, "1"])


def test_placed_groups_must_lie_on_one_node():
    """After Ray placed the bundles (sorted by node): 16 devices as 8 + 8 keep every TP=4 group and TP=2 engine of
    the DAPO recipe on one node; nodes of 6 and 10 GPUs split the second TP group and the third engine, refused."""
    from rlhf_mc.trainer.placement import check_groups_on_one_node

    recipe = load_recipe(REPO / "recipes" / "dapo_qwen3_8b.yaml")
    plan = make_plan(recipe, model_config(recipe))
    check_groups_on_one_node(plan, ["a"] * 8 + ["b"] * 8, 8)
    with pytest.raises(ConfigError, match=r"^resources: Ray placed the actor tensor-parallel group \(devices 4-7\) "
                                          r"on 2 nodes \['a', 'b'\]; give every node resources.devices_per_node=8"):
        check_groups_on_one_node(plan, ["a"] * 6 + ["b"] * 10, 8)
    with pytest.raises(ConfigError, match=r"rollout engine 3 \(devices 6-7\)"):
        check_groups_on_one_node(dataclasses.replace(plan, tp_groups=[]), ["a"] * 7 + ["b"] * 9, 8)
