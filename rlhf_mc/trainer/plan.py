"""The plan: a recipe's numbers resolved against the resources (batch sizes normalized to sequences per
data-parallel rank, every divisibility rule checked, where each role and engine runs) before any process starts;
what --dry-run prints. And the launch checks --dry-run leaves out."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
from pathlib import Path

from rlhf_mc.bridge.adapters import read_peft_adapter
from rlhf_mc.config import ConfigError, ModelConfig, RouterConfig, import_by_path
from rlhf_mc.data.dataset import DATA_SUFFIXES
from rlhf_mc.models.lora import adapter_numel, check_lora
from rlhf_mc.trainer.memory import GIB, MemoryEstimate, estimate_memory
from rlhf_mc.trainer.recipe import PATHS, Recipe, TrainSection


@dataclasses.dataclass(frozen=True)
class Plan:
    """The recipe's numbers resolved against the resources; what --dry-run prints."""

    device: str
    devices: int
    actor_world: int
    actor_dp: int
    rollout_devices: int
    critic_world: int
    ref_world: int
    reward_world: int
    sequences_per_step: int
    mini_batches_per_step: int
    sequences_per_mini_batch_per_rank: int
    optimizer_steps_per_step: int
    old_logprobs_from_update: bool
    max_sequence_tokens: int
    context_length: int
    sync_transport: str
    colocated: bool  # launched engines share the training devices: the colocation schedule moves memory
    tp_groups: list[tuple[str, int, int]]  # (role, tensor-parallel size, world) of each Megatron group
    engines: list[tuple[int, int]]  # launched engines: (first device slot, TP size)
    placement: list[dict]  # one row per device: node, device index, roles
    lora: str = ""  # the actor's adapters, in words (empty: full fine-tuning)
    memory: MemoryEstimate | None = None  # per GPU (GPU runs only)

    @property
    def engines_release_memory(self) -> bool:
        """Colocated engines give their memory back while the trainer works: on GPUs (SGLang's memory saver). On CPU
        their weights and KV cache stay in host memory, which the memory saver does not manage: a release there
        frees nothing and costs a cache flush, four engine calls and three Ray round trips a step (~30 ms at the
        quickstart's size)."""
        return self.colocated and self.device == "cuda"

    def lines(self) -> list[str]:
        rows = [f"devices: {self.devices} x {self.device}; actor world {self.actor_world} (dp={self.actor_dp})"
                + (f", critic world {self.critic_world}" if self.critic_world else "")
                + (f", reference world {self.ref_world}" if self.ref_world else "")
                + (f", reward model world {self.reward_world}" if self.reward_world else ""),
                f"per step: {self.sequences_per_step} sequences in {self.mini_batches_per_step} mini-batch(es) x "
                f"epochs = {self.optimizer_steps_per_step} optimizer step(s); "
                f"{self.sequences_per_mini_batch_per_rank} sequences per mini-batch per data-parallel rank",
                "old log-probs: " + ("the update's own (one on-policy optimizer step)"
                                     if self.old_logprobs_from_update else "a forward pass before the update"),
                f"longest sequence {self.max_sequence_tokens} tokens; engine context {self.context_length}; "
                f"weight sync: {self.sync_transport}"
                + ("; colocated: engines release their memory while the trainer works" if self.engines_release_memory
                   else "; colocated (on CPU the engines keep their memory: a release frees nothing)"
                   if self.colocated else ""),
                *([f"LoRA: {self.lora}"] if self.lora else []),
                "placement:"]
        rows += [f"  node {p['node']} device {p['device']}: {', '.join(p['roles'])}" for p in self.placement]
        return rows + (self.memory.lines() if self.memory else [])


def _in_section(prefix: str, check, *args):
    """Runs a check whose errors name fields relative to a section; re-raises them with the section's path."""
    try:
        return check(*args)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}") from None


def _mini_batch(section: TrainSection, recipe: Recipe, role: str, world: int) -> tuple[int, int]:
    """(mini-batches per step, sequences per mini-batch per DP rank) for the actor or critic."""
    data, n = recipe.data, recipe.rollout.n
    mini = section.ppo_mini_batch_size or data.train_batch_size
    if data.train_batch_size % mini:
        raise ConfigError(f"{role}.ppo_mini_batch_size: {mini} does not divide data.train_batch_size="
                          f"{data.train_batch_size}")
    dp = _in_section(f"{role}.", section.parallel.dp, world)
    if (mini * n) % dp:
        raise ConfigError(f"{role}.ppo_mini_batch_size: {mini} prompts x rollout.n={n} = {mini * n} sequences do not "
                          f"divide over {role} data-parallel size {dp} ({world} devices / tp*pp*cp="
                          f"{section.parallel.model_parallel_size})")
    return data.train_batch_size // mini, mini * n // dp


def make_plan(recipe: Recipe, model: ModelConfig, cuda: bool | None = None) -> Plan:
    """Checks every cross-field rule and returns the plan. Raises ConfigError naming the fields and numbers."""
    if not recipe.data.train_path and not recipe.sft.only:
        raise ConfigError("data.train_path: required (unless sft.only)")
    res = recipe.resources
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    device = "cuda" if res.device == "cuda" or (res.device == "auto" and cuda) else "cpu"
    devices = res.nodes * res.devices_per_node
    engine = recipe.rollout.engine
    rollout_devices = 0 if engine.addresses else engine.num_engines * engine.tp  # attached: not ours to place
    colocated = recipe.rollout.placement == "colocated"
    if recipe.rollout.mode != "sync" and colocated and not engine.addresses:
        raise ConfigError(f"rollout.mode: {recipe.rollout.mode} generates while the actor trains: the engines need "
                          "devices of their own (rollout.placement=disaggregated, or rollout.engine.addresses)")
    if colocated:
        if rollout_devices > devices:
            raise ConfigError(f"rollout.engine: num_engines*tp = {rollout_devices} exceeds the {devices} devices "
                              f"(resources.nodes*devices_per_node)")
        train_devices = devices
    else:
        train_devices = devices - rollout_devices
        if train_devices < 1:
            raise ConfigError(f"rollout.placement: disaggregated, but num_engines*tp = {rollout_devices} leaves "
                              f"no device of the {devices} for training")
    separate_ref = recipe.uses_reference and recipe.ref.placement == "separate"
    # Roles share the training devices (Megatron workers of each role are colocated, as verl does).
    actor_world = critic_world = train_devices
    for role, section in (("actor", recipe.actor), *((("critic", recipe.critic),) if recipe.uses_critic else ())):
        _in_section(f"{role}.parallel.", section.parallel.check_model, model)
        if section.router != RouterConfig() and not model.num_experts:
            raise ConfigError(f"{role}.router: the router losses are read only for mixture-of-experts models; "
                              f"{model.name or model.family} is dense")
        if section.router.bias_update_rate and not model.moe_expert_bias:
            raise ConfigError(f"{role}.router.bias_update_rate: {section.router.bias_update_rate} moves an expert "
                              f"bias, which {model.name or model.family} has none of")
        if section.router.replay and (role == "critic" or section.recompute != "none"):
            raise ConfigError(f"{role}.router.replay: routing replay is the actor's, with recompute=none (a "
                              f"recomputed forward would replay another micro-batch's routing); got {role} with "
                              f"recompute={section.recompute}")
        if model.num_experts and section.parallel.tp > 1 and device == "cpu":
            raise ConfigError(f"{role}.parallel.tp: {section.parallel.tp} with a mixture-of-experts model: Megatron "
                              "trains MoE with TP only with sequence parallelism, whose norms need Transformer Engine "
                              "(GPU); on CPU use tp=1 (and ep to split the experts)")
    check_lora(recipe.actor.lora, model, use_te=False)  # Transformer Engine: refused where it loads (the workers)
    if model.family == "qwen3_moe" and model.dense_layer_ids:
        raise ConfigError(f"model: a Qwen3-MoE model with dense layers {list(model.dense_layer_ids)} (mlp_only_layers / "
                          "decoder_sparse_step): SGLang 0.5.23 serves every Qwen3-MoE layer as an MoE layer "
                          "(sglang/srt/models/qwen3_moe.py), so the engines cannot serve it; the bridge, "
                          "tools/convert_checkpoint.py and tools/score.py take it")
    ref_world = train_devices if separate_ref else 0
    if separate_ref:
        _in_section("ref.parallel.", recipe.ref.parallel.check_model, model)
        _in_section("ref.", recipe.ref.parallel.dp, ref_world)
    reward_world = train_devices if recipe.reward.model else 0
    if reward_world:
        _in_section("reward.", recipe.reward.parallel.dp, reward_world)
    teacher = recipe.teacher
    megatron_teacher = bool(teacher.path) and teacher.backend == "megatron"
    if megatron_teacher:
        _in_section("teacher.", teacher.parallel.dp, train_devices)
    for name, served in (("teacher", teacher.path and teacher.backend == "engine"), ("judge", recipe.judge.path)):
        cfg = getattr(recipe, name).engine
        if served and not cfg.addresses and device == "cuda" and cfg.mem_fraction_static is None:
            raise ConfigError(f"{name}.engine.mem_fraction_static: required on GPU: the {name}'s engine shares the "
                              "rollout engines' GPUs; give it its fraction of their memory (and lower "
                              "rollout.engine.mem_fraction_static to leave it)")
        if served and not cfg.addresses and cfg.tp > rollout_devices and not engine.addresses:
            raise ConfigError(f"{name}.engine.tp: {cfg.tp} exceeds the rollout engines' {rollout_devices} devices, "
                              "which it runs on")
    mini_batches, per_rank = _mini_batch(recipe.actor, recipe, "actor", actor_world)
    if recipe.uses_critic:
        _mini_batch(recipe.critic, recipe, "critic", critic_world)
    if recipe.rollout.n == 1 and recipe.algorithm.estimator in ("grpo", "rloo"):
        raise ConfigError(f"rollout.n: 1 with algorithm.estimator={recipe.algorithm.estimator} leaves every group "
                          "without a baseline (a group of one keeps its raw score: REINFORCE); use n >= 2, or "
                          "estimator=reinforce_pp for REINFORCE with a batch baseline")
    sequences = recipe.data.train_batch_size * recipe.rollout.n
    if sequences < 2 and recipe.algorithm.estimator in ("gae", "reinforce_pp", "reinforce_pp_baseline"):
        raise ConfigError(f"data.train_batch_size: {recipe.data.train_batch_size} prompt(s) x rollout.n="
                          f"{recipe.rollout.n} = {sequences} sequence a step: algorithm.estimator="
                          f"{recipe.algorithm.estimator} whitens its advantages over the step's tokens, which needs "
                          "at least 2 sequences")
    if recipe.algorithm.dynamic_sampling_max_rounds and (
            recipe.rollout.n < 2 or recipe.algorithm.estimator not in ("grpo", "rloo", "reinforce_pp_baseline")):
        raise ConfigError(f"algorithm.dynamic_sampling_max_rounds: dynamic sampling drops groups of equal scores; "
                          f"it needs a group estimator (grpo, rloo, reinforce_pp_baseline) and rollout.n >= 2, got "
                          f"{recipe.algorithm.estimator} with n={recipe.rollout.n}")
    if recipe.reward.overlong_buffer >= recipe.data.max_response_length:
        raise ConfigError(f"reward.overlong_buffer: {recipe.reward.overlong_buffer} must be below "
                          f"data.max_response_length={recipe.data.max_response_length}")
    longest = recipe.data.max_prompt_length + recipe.data.max_response_length
    for role, section in (("actor", recipe.actor), *((("critic", recipe.critic),) if recipe.uses_critic else ())):
        if section.micro_batch_tokens * section.parallel.cp < longest:
            raise ConfigError(f"{role}.micro_batch_tokens: {section.micro_batch_tokens} (x cp="
                              f"{section.parallel.cp}) cannot hold one sequence of data.max_prompt_length + "
                              f"data.max_response_length = {longest} tokens")
    if longest > model.max_position_embeddings:
        raise ConfigError(f"data.max_response_length: prompt + response = {longest} tokens exceed the model's "
                          f"max_position_embeddings={model.max_position_embeddings}")
    context = engine.context_length or model.max_position_embeddings
    if context < longest + 2:
        raise ConfigError(f"rollout.engine.context_length: {context} is shorter than data.max_prompt_length + "
                          f"data.max_response_length + 2 = {longest + 2}")
    attached = bool(engine.addresses)
    transport = recipe.rollout.sync_transport
    if transport == "auto":
        transport = "tensor" if colocated and not attached else "distributed"
    if transport == "tensor" and not colocated:
        raise ConfigError("rollout.sync_transport: tensor needs rollout.placement=colocated (tensors are handed "
                          "over by reference on one machine)")
    if transport == "tensor" and attached:
        raise ConfigError("rollout.sync_transport: tensor needs engines the trainer launches on its own devices; "
                          "attached engines (rollout.engine.addresses) take distributed or disk")
    if _adapter_sync(recipe, model, attached, device):
        if recipe.rollout.sync_transport != "auto":
            raise ConfigError(f"rollout.sync_transport: {recipe.rollout.sync_transport} with actor.lora.sync="
                              f"{recipe.actor.lora.sync}: the adapter goes by its own transport; leave it at auto or "
                              "set actor.lora.sync=merged")
        transport = "adapter"
    # Megatron's tensor-parallel groups are consecutive ranks and device slots fill nodes in order: a group lies on
    # one node when its size divides the devices per node. Engines likewise, wherever their slots start.
    per_node = res.devices_per_node
    tp_groups = [("actor", recipe.actor.parallel.tp, actor_world)]
    if recipe.uses_critic:
        tp_groups.append(("critic", recipe.critic.parallel.tp, critic_world))
    if separate_ref:
        tp_groups.append(("ref", recipe.ref.parallel.tp, ref_world))
    if reward_world:
        tp_groups.append(("reward", recipe.reward.parallel.tp, reward_world))
    if megatron_teacher:
        tp_groups.append(("teacher", teacher.parallel.tp, train_devices))
    for role, tp, _ in tp_groups:
        if per_node % tp:
            raise ConfigError(f"{role}.parallel.tp: {tp} does not divide resources.devices_per_node={per_node}: a "
                              "tensor-parallel group must lie on one node")
    first = 0 if colocated else train_devices
    engines = [] if attached else [(first + e * engine.tp, engine.tp) for e in range(engine.num_engines)]
    for e, (start, tp) in enumerate(engines):
        if start // per_node != (start + tp - 1) // per_node:
            raise ConfigError(f"rollout.engine.tp: engine {e} (tp={tp}) would span devices {start}-{start + tp - 1}"
                              f" on two nodes of resources.devices_per_node={per_node}; an engine must lie on one "
                              "node")
    placement = []
    for d in range(devices):
        roles = []
        if d < train_devices:
            roles.append(f"actor rank {d}")
            if recipe.uses_critic:
                roles.append(f"critic rank {d}")
            if separate_ref:
                roles.append(f"reference rank {d}")
            if reward_world:
                roles.append(f"reward model rank {d}")
        engine_slot = d if colocated else d - train_devices
        if 0 <= engine_slot < rollout_devices:
            roles.append(f"rollout engine {engine_slot // engine.tp} tp rank {engine_slot % engine.tp}")
        placement.append({"node": d // res.devices_per_node, "device": d % res.devices_per_node, "roles": roles})
    epochs = recipe.actor.ppo_epochs
    memory = (estimate_memory(recipe, model, actor_world, colocated and not attached,
                              res.gpu_memory_gib * GIB or _local_gpu_bytes()) if device == "cuda" else None)
    return Plan(device=device, devices=devices, actor_world=actor_world, actor_dp=recipe.actor.parallel.dp(actor_world),
                rollout_devices=rollout_devices, critic_world=critic_world if recipe.uses_critic else 0,
                ref_world=ref_world, reward_world=reward_world,
                sequences_per_step=recipe.data.train_batch_size * recipe.rollout.n,
                mini_batches_per_step=mini_batches, sequences_per_mini_batch_per_rank=per_rank,
                optimizer_steps_per_step=mini_batches * epochs,
                old_logprobs_from_update=recipe.old_logprobs_from_update, max_sequence_tokens=longest,
                context_length=context,
                sync_transport=transport, colocated=colocated and not attached, tp_groups=tp_groups, engines=engines,
                placement=placement, lora=_lora_line(recipe, model, transport), memory=memory)


def _local_gpu_bytes() -> int | None:
    """This machine's first GPU's memory, as nvidia-smi reports it (torch would make a CUDA context in the launcher,
    on the GPU the first rank and engine use); None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out.stdout.split()[0]) * 2**20 if out.returncode == 0 and out.stdout.strip() else None


def _adapter_sync(recipe: Recipe, model: ModelConfig, attached: bool, device: str) -> bool:
    """Whether the engines serve the actor's LoRA adapter (else: the adapted layers are synced merged). auto: on GPU,
    where the trainer launches the engines (it sets their LoRA serving flags), for dense models; on CPU merged:
    SGLang's plain-torch LoRA serving made the real model's rollout 19% slower than merged weights (19.0 s against
    16.0 s a step, bench/lora.py), more than the merged layers' sync costs over the adapter's (1.0 s against 0.8)."""
    lora = recipe.actor.lora
    if not lora.enabled or lora.sync == "merged":
        return False
    if lora.sync == "adapter" and attached:
        raise ConfigError("actor.lora.sync: adapter needs engines the trainer launches (with LoRA serving on); "
                          "attached engines (rollout.engine.addresses) take sync=merged")
    # without model.path or with an SFT stage the engines start on placeholder weights (--load-format dummy), onto
    # which SGLang loads no adapter
    placeholder = not recipe.model.path or bool(recipe.sft.data_path)
    if lora.sync == "adapter" and placeholder:
        raise ConfigError("actor.lora.sync: adapter needs model.path and no SFT stage (the engines start before the "
                          "base weights exist, and SGLang loads no adapter onto placeholder weights); use merged")
    if lora.sync == "adapter" and model.num_experts:
        raise ConfigError("actor.lora.sync: adapter with a mixture-of-experts model: SGLang's LoRA serving of MoE "
                          "models is not tried here; use sync=merged")
    return lora.sync == "adapter" or (not attached and not model.num_experts and device == "cuda" and not placeholder)


def _lora_line(recipe: Recipe, model: ModelConfig, transport: str) -> str:
    lora = recipe.actor.lora
    if not lora.enabled:
        return ""
    params = adapter_numel(model, lora)
    start = f"from {lora.adapter_path}" if lora.adapter_path else "B = 0 (the base's outputs)"
    sync = ("the engines serve the adapter (SGLang LoRA), each sync replaces it" if transport == "adapter" else
            "each sync sends the adapted layers only, merged")
    return (f"rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: {params:,} trained parameters "
            f"({params / model.num_parameters:.2%} of {model.num_parameters:,}), {start}; the reference is the base "
            f"(adapters off); {sync}")


def check_launch(recipe: Recipe, model: ModelConfig) -> None:
    """The checks of the recipe's inputs, before Ray starts (--dry-run runs them too): input files exist and are of
    a format the run reads, HF checkpoints are complete and of a supported architecture (and match model.config
    when both are given), the reward function, rollout function and group filter import, the checkpoint to resume
    from is complete."""
    from rlhf_mc.rewards.scoring import resolve
    from rlhf_mc.trainer.checkpoints import resume_from

    for section, fields in PATHS.items():
        for field in fields:
            value = getattr(getattr(recipe, section), field)
            if value and not Path(value).exists():
                raise ConfigError(f"{section}.{field}: not found: {value}")
    for field, value in (("data.train_path", recipe.data.train_path), ("data.val_path", recipe.data.val_path),
                         ("sft.data_path", recipe.sft.data_path)):
        if value and Path(value).suffix not in DATA_SUFFIXES:
            raise ConfigError(f"{field}: {value} is not a {' or '.join(DATA_SUFFIXES)} file")
    if recipe.model.path:
        _checked_hf_dir("model.path", recipe.model.path, model if recipe.model.config else None)
    if recipe.actor.lora.adapter_path:
        read_peft_adapter(recipe.actor.lora.adapter_path, recipe.actor.lora, model)
    if recipe.reward.function:
        resolve(recipe.reward.function)
    _check_rollout_function(recipe)
    import_by_path("algorithm.group_filter", recipe.algorithm.group_filter)
    resume_from(Path(recipe.trainer.output_dir), recipe.trainer.resume)
    _check_teacher(recipe)
    if recipe.judge.enabled:
        import_by_path("judge.function", recipe.judge.function)
    if recipe.reward.model:
        from rlhf_mc.bridge.hf_config import read_hf_config

        reward_model = _checked_hf_dir("reward.model", recipe.reward.model)
        hf = read_hf_config(recipe.reward.model)
        labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default: 2 labels
        if not any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []) or labels != 1:
            raise ConfigError(f"reward.model: {recipe.reward.model} is not a one-label sequence-classification "
                              f"checkpoint (architectures {hf.get('architectures')})")
        _in_section("reward.parallel.", recipe.reward.parallel.check_model, reward_model)


def _check_teacher(recipe: Recipe) -> None:
    """The teacher is a complete HF checkpoint of a supported architecture (one a Megatron teacher can load; a
    served one needs a config), its function imports, and it tokenizes as the actor does: the same vocabulary,
    token for token (it scores the student's token ids)."""
    teacher = recipe.teacher
    if not teacher.path:
        return
    import_by_path("teacher.function", teacher.function)
    if teacher.backend == "megatron":
        _in_section("teacher.parallel.", teacher.parallel.check_model, _checked_hf_dir("teacher.path", teacher.path))
    elif not (Path(teacher.path) / "config.json").is_file():
        raise ConfigError(f"teacher.path: no HF checkpoint (config.json) at {teacher.path}")
    from transformers import AutoTokenizer  # only with a teacher: 2.3 s of every check otherwise

    ours = AutoTokenizer.from_pretrained(recipe.model.tokenizer or recipe.model.path).get_vocab()
    theirs = AutoTokenizer.from_pretrained(teacher.path).get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(f"teacher.path: {teacher.path} tokenizes differently from the actor ({len(theirs)} "
                          f"tokens vs {len(ours)}; e.g. {differ}): its log-probs of the student's token ids would "
                          "be of other text. Distill from a teacher with the actor's tokenizer")


def _checked_hf_dir(field: str, path: str, model: ModelConfig | None = None) -> ModelConfig:
    """bridge.convert.check_hf_checkpoint's verdict on an HF directory, as one line naming the field."""
    from rlhf_mc.bridge.convert import check_hf_checkpoint

    try:
        return check_hf_checkpoint(path, model)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise ConfigError(f"{field}: {path}: {reason}") from None


def _check_rollout_function(recipe: Recipe) -> None:
    """The rollout function imports and takes its arguments: rollout.function_kwargs by name, and the recipe's tools
    exactly when it has a `tools` parameter; the tools import and have schemas, the tool-call parser imports, and
    the tokenizer's chat template can hold conversations token by token (data/chat.py)."""
    from rlhf_mc.tools import parsers
    from rlhf_mc.tools.executor import tool_schema

    r = recipe.rollout
    fn = import_by_path("rollout.function", r.function)
    takes_tools = "tools" in inspect.signature(fn).parameters
    if recipe.tools.functions and not takes_tools:
        raise ConfigError(f"tools.functions: rollout.function {r.function!r} takes no tools; use "
                          "rlhf_mc.rollout.multi_turn:tool_loop or a function with a `tools` parameter")
    if takes_tools and not recipe.tools.functions:
        raise ConfigError(f"rollout.function: {r.function!r} calls tools; list them in tools.functions")
    try:
        inspect.signature(fn).bind(None, None, None, None, **r.function_kwargs, **({"tools": None} if takes_tools
                                                                                  else {}))
    except TypeError as e:
        raise ConfigError(f"rollout.function_kwargs: {r.function!r} does not take them ({e})") from None
    for path in recipe.tools.functions:
        tool_schema(path)
    parsers.resolve(recipe.tools.parser)
    if recipe.tools.functions or recipe.sft.messages_key:  # conversations go through the template: it must allow
        from transformers import AutoTokenizer

        from rlhf_mc.data.chat import Conversation

        Conversation.of(AutoTokenizer.from_pretrained(recipe.model.tokenizer or recipe.model.path))
