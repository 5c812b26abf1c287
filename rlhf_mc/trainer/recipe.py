"""The recipe: one YAML per job, typed with defaults, dotted `key=value` overrides, and the plan - batch sizes
normalized to sequences per data-parallel rank, every divisibility rule checked - before any process starts.

Batch fields are in prompts (verl's convention): `data.train_batch_size` prompts per step, `rollout.n` samples each,
`actor.ppo_mini_batch_size` prompts per optimizer step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import yaml

from rlhf_mc.algorithms.core import Aggregation, KLEstimator
from rlhf_mc.config import (ConfigError, ModelConfig, OptimizerConfig, ParallelConfig, RolloutConfig, from_dict,
                            load_yaml)

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str = ""  # HF checkpoint dir: weights, config.json, tokenizer
    config: str = ""  # a model_configs YAML: random init (then an SFT stage usually comes first)
    tokenizer: str = ""  # tokenizer dir; default: path
    dtype: Literal["float32", "bfloat16"] = "bfloat16"

    def __post_init__(self):
        if not self.path and not self.config:
            raise ConfigError("path: give model.path (an HF checkpoint dir) or model.config (a model_configs YAML)")
        if not (self.tokenizer or self.path):
            raise ConfigError("tokenizer: required when model.path is not set")


@dataclasses.dataclass(frozen=True)
class DataSection:
    train_path: str = ""  # jsonl or parquet with one prompt per row (required unless sft.only)
    val_path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # passed to the reward function as the ground truth
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    max_prompt_length: int = 512  # tokens; longer prompts are dropped when the dataset loads (and counted)
    max_response_length: int = 512
    train_batch_size: int = 8  # prompts per step
    val_size: int = 0  # held-out prompts used per validation; 0 = all
    shuffle: bool = True  # reshuffled every epoch from trainer.seed and the epoch

    def __post_init__(self):
        for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    val_n: int = 1  # samples per held-out prompt: pass@val_n is logged besides greedy accuracy
    val_temperature: float = 1.0  # for the pass@k samples (accuracy is always greedy)
    placement: Literal["colocated", "disaggregated"] = "colocated"
    sync_transport: Literal["auto", "tensor", "distributed", "disk"] = "auto"  # auto: tensor if colocated
    sync_bucket_mb: int = 256
    engine: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)  # model_path comes from the actor

    def __post_init__(self):
        for name in ("n", "val_n", "sync_bucket_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if self.engine.model_path:
            raise ConfigError("engine.model_path: set by the trainer from the actor's weights; leave it out")
        if self.engine.host != RolloutConfig.host:
            raise ConfigError(f"engine.host: {self.engine.host!r}: set by the trainer (127.0.0.1 on one node, each "
                              "node's IP when the run spans nodes); leave it out")


@dataclasses.dataclass(frozen=True)
class PolicyLossSection:
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
    reject: Literal["none", "token", "sequence", "geometric"] = "none"
    reject_low: float = 0.5
    reject_high: float = 2.0
    norm_length: int = 0  # seq-mean-token-sum-norm's constant divisor; 0 = data.max_response_length

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
        if self.reject == "none" and (self.reject_low, self.reject_high) != (0.5, 2.0):
            raise ConfigError(f"reject_low, reject_high: {self.reject_low}, {self.reject_high} are read only with "
                              "reject set (token, sequence or geometric)")
        if self.kl_loss_coef < 0:
            raise ConfigError(f"kl_loss_coef: must be >= 0, got {self.kl_loss_coef}")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """A trained model's role: the actor, or the critic (PPO with GAE)."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    ppo_mini_batch_size: int = 0  # prompts per optimizer step; 0 = the whole step's batch
    ppo_epochs: int = 1
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch per device
    recompute: Literal["none", "selective", "full"] = "none"  # activation recompute
    # parameters, gradients and optimizer state in host memory while the engines generate (colocated placement)
    offload: bool = False
    loss: PolicyLossSection = dataclasses.field(default_factory=PolicyLossSection)  # actor only
    value_clip: float = 0.2  # critic only

    def __post_init__(self):
        for name in ("ppo_epochs", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.ppo_mini_batch_size < 0:
            raise ConfigError(f"ppo_mini_batch_size: must be >= 0, got {self.ppo_mini_batch_size}")


@dataclasses.dataclass(frozen=True)
class RefSection:
    # host: frozen weights in host memory, swapped into the actor for the reference forward (no second model on the
    # devices); separate: its own worker group (parallel below)
    placement: Literal["host", "separate"] = "host"
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    offload: bool = False  # separate: its weights in host memory while the engines generate

    def __post_init__(self):
        if self.offload and self.placement == "host":
            raise ConfigError("offload: the host reference lives in host memory already; offload needs "
                              "placement=separate")


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    norm_by_std: bool = True  # GRPO: divide by the group's std (false = Dr. GRPO)
    gamma: float = 1.0
    lam: float = 1.0  # GAE lambda
    kl_in_reward_coef: float = 0.0  # KL to the reference subtracted from the token rewards (PPO style)
    kl_in_reward_estimator: KLEstimator = "k1"
    # > 0: the KL-in-reward coefficient adapts toward this KL (verl's adaptive controller; kl_in_reward_coef is its
    # start), at a rate set by kl_horizon (sequences)
    kl_target: float = 0.0
    kl_horizon: int = 10000
    # With one optimizer step per batch (one mini-batch, one epoch) the old policy is the current one: the update's
    # own log-probs, detached, stand for the old ones, and their forward pass is skipped (verl and slime run it).
    skip_on_policy_old_logprobs: bool = True
    # DAPO's dynamic sampling: the groups whose scores are all equal (zero advantages) are dropped and rollouts go
    # on, on more prompts, until data.train_batch_size prompts have groups that differ; at most this many rollout
    # rounds per step (then the step fails, saying so); 0 = off
    dynamic_sampling_max_rounds: int = 0

    def __post_init__(self):
        if self.kl_target < 0 or self.kl_horizon < 1:
            raise ConfigError(f"kl_target, kl_horizon: need kl_target >= 0 and kl_horizon >= 1, got "
                              f"{self.kl_target}, {self.kl_horizon}")
        adaptive = self.kl_target > 0 or self.kl_horizon != AlgorithmSection.kl_horizon
        if adaptive and not (self.kl_target > 0 and self.kl_in_reward_coef > 0):
            raise ConfigError(f"kl_target: the adaptive KL controller needs kl_target > 0 and a starting "
                              f"kl_in_reward_coef > 0, got kl_target={self.kl_target}, kl_in_reward_coef="
                              f"{self.kl_in_reward_coef}")
        if self.dynamic_sampling_max_rounds < 0:
            raise ConfigError(f"dynamic_sampling_max_rounds: must be >= 0, got {self.dynamic_sampling_max_rounds}")


@dataclasses.dataclass(frozen=True)
class RewardSection:
    # a built-in rule ("math", "format", "math_and_format") or an import path "package.module:function" called as
    # fn(response: str, answer: str, prompt: str, **kwargs) -> float; "" = none (a reward model alone)
    function: str = "math"
    # a learned reward: an HF sequence-classification checkpoint (one label) run as its own Megatron worker group;
    # its score of prompt + response is added to the rule's
    model: str = ""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)  # of the reward model
    kwargs: dict = dataclasses.field(default_factory=dict)
    timeout_s: float = 10.0  # for one batch's scores; a failure or a late score gets failure_score and is counted
    failure_score: float = 0.0
    correct_score: float = 1.0  # a score at or above it counts as correct (accuracy, pass@k)
    workers: int = 4  # reward calls in flight
    # DAPO's overlong shaping: over the last overlong_buffer tokens of data.max_response_length a penalty grows
    # linearly from 0 to overlong_penalty (at the full budget), added to the score; 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        if not self.function and not self.model:
            raise ConfigError("function: no reward: give reward.function, reward.model or both")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError(f"overlong_buffer, overlong_penalty: must be >= 0, got {self.overlong_buffer}, "
                              f"{self.overlong_penalty}")


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised fine-tuning on prompt/response rows; in an RL recipe a first stage that runs when the run has no
    checkpoint yet (the warm start)."""

    data_path: str = ""  # jsonl/parquet with prompt_key and response_key; empty = no SFT stage
    only: bool = False  # an SFT job: stop after the SFT stage (its model is <output_dir>/init_hf)
    response_key: str = "response"
    steps: int = 0
    batch_size: int = 32  # sequences per step
    optim: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    micro_batch_tokens: int = 8192

    def __post_init__(self):
        if self.data_path and self.steps < 1:
            raise ConfigError(f"steps: must be >= 1 with sft.data_path set, got {self.steps}")
        if self.only and not self.data_path:
            raise ConfigError("only: an SFT-only job needs sft.data_path")


@dataclasses.dataclass(frozen=True)
class ResourcesSection:
    nodes: int = 1
    devices_per_node: int = 1  # GPUs per node; on a machine without GPUs, processes (each given one CPU by Ray)
    device: Literal["auto", "cuda", "cpu"] = "auto"


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    total_steps: int = 0  # 0: total_epochs over the training set
    total_epochs: int = 1
    val_interval: int = 0  # steps; 0 = only at the start and the end
    save_interval: int = 0  # steps; 0 = only at the end
    keep_checkpoints: int = 2
    output_dir: str = "runs/default"
    resume: str = "auto"  # auto: continue from the newest complete checkpoint in output_dir; never; or a path
    export_hf: bool = True  # write the final actor as an HF checkpoint
    loggers: tuple[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"], ...] = ("console", "jsonl",
                                                                                          "tensorboard")
    project: str = "rlhf_mc"
    experiment: str = ""
    seed: int = 1234

    def __post_init__(self):
        if self.total_steps < 0 or self.total_epochs < 1:
            raise ConfigError(f"total_steps/total_epochs: got {self.total_steps}/{self.total_epochs}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints: must be >= 1, got {self.keep_checkpoints}")


@dataclasses.dataclass(frozen=True)
class Recipe:
    model: ModelSection
    data: DataSection
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    actor: TrainSection = dataclasses.field(default_factory=TrainSection)
    ref: RefSection = dataclasses.field(default_factory=RefSection)
    critic: TrainSection = dataclasses.field(default_factory=TrainSection)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    resources: ResourcesSection = dataclasses.field(default_factory=ResourcesSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)

    def __post_init__(self):
        # One section type serves the actor and the critic: each reads only its own loss fields.
        if self.critic.loss != PolicyLossSection():
            raise ConfigError("critic.loss: the critic's loss is the clipped value loss (critic.value_clip); the "
                              "policy loss is actor.loss")
        if self.actor.value_clip != TrainSection.value_clip:
            raise ConfigError(f"actor.value_clip: {self.actor.value_clip} is the critic's (critic.value_clip)")

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.actor.loss.kl_loss_coef > 0 or self.algorithm.kl_in_reward_coef > 0

    @property
    def old_logprobs_from_update(self) -> bool:
        """The step's one optimizer step computes the old log-probs (see skip_on_policy_old_logprobs); the KL in
        the reward needs them before the advantages, so it keeps the forward."""
        actor = self.actor
        return (self.algorithm.skip_on_policy_old_logprobs and actor.ppo_epochs == 1
                and actor.ppo_mini_batch_size in (0, self.data.train_batch_size)
                and self.algorithm.kl_in_reward_coef == 0)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b.c=value` (value parsed as YAML) into the nested mapping; the schema check afterwards names bad keys."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parents[:i + 1])}: is not a section, cannot set {key}")
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return data


def resolve_path(path: str) -> Path:
    """Paths in recipes are relative to the working directory, or else to the repository (for shipped files)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() or not (REPO / p).exists() else REPO / p


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    data = apply_overrides(load_yaml(path), list(overrides))
    return from_dict(Recipe, data)


def model_config(recipe: Recipe) -> ModelConfig:
    """The architecture: from model.config when given, else from the HF checkpoint's config.json."""
    if recipe.model.config:
        path = resolve_path(recipe.model.config)
        if not path.is_file():
            raise ConfigError(f"model.config: file not found: {recipe.model.config}")
        return ModelConfig.from_yaml(path)
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config

    path = resolve_path(recipe.model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: no HF checkpoint (config.json) at {recipe.model.path}")
    return model_config_from_hf(read_hf_config(path))


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
                + ("; colocated: engines release their memory while the trainer works" if self.colocated else ""),
                "placement:"]
        rows += [f"  node {p['node']} device {p['device']}: {', '.join(p['roles'])}" for p in self.placement]
        return rows


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
        if section.parallel.ep > 1:
            raise ConfigError(f"{role}.parallel.ep: {section.parallel.ep} needs a mixture-of-experts model; "
                              f"{model.name or model.family} is dense")
    ref_world = train_devices if separate_ref else 0
    if separate_ref:
        _in_section("ref.parallel.", recipe.ref.parallel.check_model, model)
        _in_section("ref.", recipe.ref.parallel.dp, ref_world)
    reward_world = train_devices if recipe.reward.model else 0
    if reward_world:
        _in_section("reward.", recipe.reward.parallel.dp, reward_world)
    mini_batches, per_rank = _mini_batch(recipe.actor, recipe, "actor", actor_world)
    if recipe.uses_critic:
        _mini_batch(recipe.critic, recipe, "critic", critic_world)
    if recipe.rollout.n == 1 and recipe.algorithm.estimator in ("grpo", "rloo"):
        raise ConfigError(f"rollout.n: 1 with algorithm.estimator={recipe.algorithm.estimator} gives every sample a "
                          "zero advantage (a group of one); use n >= 2")
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
    return Plan(device=device, devices=devices, actor_world=actor_world, actor_dp=recipe.actor.parallel.dp(actor_world),
                rollout_devices=rollout_devices, critic_world=critic_world if recipe.uses_critic else 0,
                ref_world=ref_world, reward_world=reward_world,
                sequences_per_step=recipe.data.train_batch_size * recipe.rollout.n,
                mini_batches_per_step=mini_batches, sequences_per_mini_batch_per_rank=per_rank,
                optimizer_steps_per_step=mini_batches * epochs,
                old_logprobs_from_update=recipe.old_logprobs_from_update, max_sequence_tokens=longest,
                context_length=context,
                sync_transport=transport, colocated=colocated and not attached, tp_groups=tp_groups, engines=engines,
                placement=placement)


def check_launch(recipe: Recipe) -> None:
    """What --dry-run does not check (it may run away from the data): input files exist, the reward function
    imports, the checkpoint to resume from is complete."""
    from rlhf_mc.rewards.scoring import resolve
    from rlhf_mc.trainer.checkpoints import resume_from

    if recipe.reward.function:
        resolve(recipe.reward.function)
    resume_from(Path(recipe.trainer.output_dir), recipe.trainer.resume)
    if recipe.reward.model:
        from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config

        path = resolve_path(recipe.reward.model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"reward.model: no HF checkpoint (config.json) at {recipe.reward.model}")
        hf = read_hf_config(path)
        labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default: 2 labels
        if not any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []) or labels != 1:
            raise ConfigError(f"reward.model: {recipe.reward.model} is not a one-label sequence-classification "
                              f"checkpoint (architectures {hf.get('architectures')})")
        _in_section("reward.parallel.", recipe.reward.parallel.check_model, model_config_from_hf(hf))
    for key, value in (("model.path", recipe.model.path), ("model.tokenizer", recipe.model.tokenizer),
                       ("data.train_path", recipe.data.train_path), ("data.val_path", recipe.data.val_path),
                       ("sft.data_path", recipe.sft.data_path)):
        if value and not resolve_path(value).exists():
            raise ConfigError(f"{key}: not found: {value}")


def to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)
