"""The recipe: one YAML per job, typed with defaults, dotted `key=value` overrides, every value checked when it
loads (trainer/plan.py then checks it against the resources).

Batch fields are in prompts (verl's convention): `data.train_batch_size` prompts per step, `rollout.n` samples each,
`actor.ppo_mini_batch_size` prompts per optimizer step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import yaml

from rlhf_mc.algorithms.core import KLEstimator
from rlhf_mc.config import (ConfigError, LoraConfig, ModelConfig, OptimizerConfig, ParallelConfig, PolicyLossConfig,
                            RolloutConfig, RouterConfig, ToolsConfig, check_at_least, from_dict, load_yaml)

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
        check_at_least(self, 1, "max_prompt_length", "max_response_length", "train_batch_size")
        check_at_least(self, 0, "val_size")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # training rollouts run to data.max_response_length whatever they sample (verl's rollout.ignore_eos): equal
    # work per sample for benchmarks and length-controlled runs; validation still stops at EOS
    ignore_eos: bool = False
    val_n: int = 1  # samples per held-out prompt: pass@val_n is logged besides greedy accuracy
    val_temperature: float = 1.0  # for the pass@k samples (accuracy is always greedy)
    placement: Literal["colocated", "disaggregated"] = "colocated"
    # sync: each step's rollout uses the weights the step trains (on-policy); one_step_off: the rollout of step k+1
    # runs while the actor trains on step k, so every trained token is at most one weight version old (the
    # engines need devices of their own; the old log-probs come from a forward pass of the weights being trained,
    # the proximal policy of decoupled PPO, and actor.loss.tis_cap / reject correct for the behaviour policy);
    # async: groups are generated without pause while the actor trains, admitted while at most max_staleness
    # versions old (trainer/stream.py), and a sync pauses those under way (partial rollouts)
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int | None = None  # async: how many weight versions a trained token may lag (default 1)
    sync_transport: Literal["auto", "tensor", "distributed", "disk"] = "auto"  # auto: tensor if colocated
    sync_bucket_mb: int = 256
    engine: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)  # model_path comes from the actor
    # the rollout function, "package.module:function" (rollout/functions.py: the signature), called with
    # function_kwargs as keyword arguments
    function: str = "rlhf_mc.rollout.functions:single_turn"
    function_kwargs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check_at_least(self, 1, "n", "val_n", "sync_bucket_mb")
        if self.max_staleness is not None and self.mode != "async":
            raise ConfigError(f"max_staleness: {self.max_staleness} is read in async mode only (mode={self.mode}: "
                              f"{self.staleness_bound} by definition)")
        if self.max_staleness is not None:
            check_at_least(self, 0, "max_staleness")
        check_at_least(self, 0, "temperature", "val_temperature")  # 0 = greedy
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must lie in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k: must be -1 (the whole vocabulary) or >= 1, got {self.top_k}")
        if self.engine.model_path:
            raise ConfigError("engine.model_path: set by the trainer from the actor's weights; leave it out")
        if self.engine.return_routed_experts:
            raise ConfigError("engine.return_routed_experts: set by the trainer for mixture-of-experts models; "
                              "leave it out")
        if self.engine.lora_adapter:
            raise ConfigError("engine.lora_adapter: set by the trainer (actor.lora with sync=adapter); leave it out")
        if self.engine.random_weights:
            raise ConfigError("engine.random_weights: set by the trainer (engines start so when the run has no "
                              "checkpoint yet); leave it out")
        if self.engine.host != RolloutConfig.host:
            raise ConfigError(f"engine.host: {self.engine.host!r}: set by the trainer (127.0.0.1 on one node, each "
                              "node's IP when the run spans nodes); leave it out")

    @property
    def staleness_bound(self) -> int:
        """How many weight versions older than the trained one a sampled token may be."""
        return {"sync": 0, "one_step_off": 1, "async": 1 if self.max_staleness is None else self.max_staleness}[
            self.mode]


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
    loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)  # actor only
    value_clip: float = 0.2  # critic only
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)  # mixture-of-experts models only
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # actor only

    def __post_init__(self):
        check_at_least(self, 1, "ppo_epochs", "micro_batch_tokens")
        check_at_least(self, 0, "ppo_mini_batch_size")
        if self.value_clip <= 0:
            raise ConfigError(f"value_clip: must be > 0, got {self.value_clip}")


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
    # distill: on-policy distillation alone, the teacher's per-token advantage (teacher section) without an outcome
    # one (scores are still computed: logged, and read by validation); with any other estimator a teacher's
    # advantage is added to the estimator's
    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "distill"] = "grpo"
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
    # what dynamic sampling keeps: keep(scores of a prompt's group) -> bool, "package.module:function"
    group_filter: str = "rlhf_mc.rollout.functions:scores_differ"

    def __post_init__(self):
        if self.kl_target < 0 or self.kl_horizon < 1:
            raise ConfigError(f"kl_target, kl_horizon: need kl_target >= 0 and kl_horizon >= 1, got "
                              f"{self.kl_target}, {self.kl_horizon}")
        adaptive = self.kl_target > 0 or self.kl_horizon != AlgorithmSection.kl_horizon
        if adaptive and not (self.kl_target > 0 and self.kl_in_reward_coef > 0):
            raise ConfigError(f"kl_target: the adaptive KL controller needs kl_target > 0 and a starting "
                              f"kl_in_reward_coef > 0, got kl_target={self.kl_target}, kl_in_reward_coef="
                              f"{self.kl_in_reward_coef}")
        check_at_least(self, 0, "dynamic_sampling_max_rounds", "kl_in_reward_coef")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name}: must lie in [0, 1], got {getattr(self, name)}")
        if self.group_filter != AlgorithmSection.group_filter and not self.dynamic_sampling_max_rounds:
            raise ConfigError(f"group_filter: {self.group_filter!r} is read only with dynamic sampling on "
                              "(dynamic_sampling_max_rounds > 0)")


@dataclasses.dataclass(frozen=True)
class RewardSection:
    # a built-in rule ("math", "format", "math_and_format") or an import path "package.module:function" called as
    # fn(response: str, answer: str, prompt: str, **kwargs) -> float, and with messages=<the exchange after the
    # prompt> when it has a `messages` parameter (multi-turn); "" = none (a reward model alone)
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
        check_at_least(self, 0, "overlong_buffer", "overlong_penalty")
        check_at_least(self, 1, "workers")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be > 0, got {self.timeout_s}")


def _served_engine(section: str, engine: RolloutConfig, unread: tuple[tuple[str, str], ...] = ()) -> None:
    """The settings of a served model's SGLang engine (teacher, judge) that the trainer sets or that nothing reads
    there (`unread`: (field, what to set instead) pairs), refused by name (relative to the section: from_dict adds it)."""
    for name in ("model_path", "return_routed_experts", "lora_adapter", "random_weights"):
        if getattr(engine, name) != getattr(RolloutConfig, name):
            raise ConfigError(f"engine.{name}: {getattr(engine, name)!r}: the served model's engine starts from "
                              f"{section}.path (or attaches by addresses) and serves it as it is; leave it out")
    if engine.host != RolloutConfig.host:
        raise ConfigError(f"engine.host: {engine.host!r}: set by the trainer; leave it out")
    if engine.max_restarts != RolloutConfig.max_restarts:
        raise ConfigError(f"engine.max_restarts: {engine.max_restarts}: a served model's engine is not restarted "
                          "(a dead teacher fails the step, a dead judge's calls are scored as failures)")
    for name, instead in unread:
        if getattr(engine, name) != getattr(RolloutConfig, name):
            raise ConfigError(f"engine.{name}: {getattr(engine, name)!r} is not read for the {section}: set "
                              f"{section}.{instead}")


@dataclasses.dataclass(frozen=True)
class TeacherSection:
    """On-policy distillation: a teacher's log-probs of the student's own sampled tokens, and per token the
    advantage kl_coef * (log p_teacher - log p_student) (algorithms/core.distillation_advantages) added to the
    estimator's (algorithm.estimator=distill: the teacher's alone). The teacher must share the actor's tokenizer."""

    path: str = ""  # the teacher's HF checkpoint; "" = no teacher
    # engine: an SGLang server asked for the log-probs of the given tokens (prefill only), launched here on the
    # rollout engines' devices (or attached by engine.addresses); megatron: a worker group on the training devices,
    # like a separate reference (parallel below)
    backend: Literal["engine", "megatron"] = "engine"
    kl_coef: float = 1.0
    engine: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    micro_batch_tokens: int = 8192  # megatron: the token budget of its forward's micro-batches
    offload: bool = False  # megatron: its weights in host memory while the engines generate (colocated placement)
    # the teacher's log-probs of a batch: fn(teacher, batch: Trajectories) -> [T] tensor (trajectory.py's per-token
    # layout), "package.module:function"; `teacher` has .logprobs(batch) and, served, .engine (rollout/sglang_engine)
    function: str = "rlhf_mc.trainer.teacher:token_logprobs"

    def __post_init__(self):
        if self.kl_coef <= 0:
            raise ConfigError(f"kl_coef: must be > 0, got {self.kl_coef}")
        check_at_least(self, 1, "micro_batch_tokens")
        _served_engine("teacher", self.engine)
        if not self.path and self.engine != RolloutConfig():
            raise ConfigError("path: teacher.engine set without teacher.path, the teacher's HF checkpoint (its "
                              "tokenizer is checked against the actor's, and it is what a launched engine serves)")
        if self.backend == "megatron" and self.engine != RolloutConfig():
            raise ConfigError("engine: set with teacher.backend=megatron, which runs no engine; leave it out or set "
                              "backend=engine")
        if self.backend == "engine" and self.micro_batch_tokens != TeacherSection.micro_batch_tokens:
            raise ConfigError(f"micro_batch_tokens: {self.micro_batch_tokens} is the Megatron teacher's "
                              "(teacher.backend=megatron); a served teacher's engine batches by itself")
        if self.backend == "engine" and self.offload:
            raise ConfigError("offload: the Megatron teacher's (teacher.backend=megatron); a served teacher's engine "
                              "keeps its memory")
        if self.backend == "engine" and self.parallel != ParallelConfig():
            raise ConfigError("parallel: the Megatron teacher's (teacher.backend=megatron); the served teacher's "
                              "engine takes teacher.engine.tp")


@dataclasses.dataclass(frozen=True)
class JudgeSection:
    """A generative reward: an LLM judge served by its own SGLang engine (launched here on the rollout engines'
    devices, or attached by engine.addresses) reads each response in `template` and answers; `parser` reads its
    verdict. The score (a number in score_range mapped to [0, 1], or a label's value from `labels`) times `weight`
    is added to the rule's. A call that times out or fails is retried `retries` times; one still unanswered, or an
    answer without a verdict (not retried: the judge answers greedily), is scored failure_score and counted
    (reward/judge_*). A call takes at most (retries + 1) * timeout_s."""

    path: str = ""  # the judge's HF checkpoint (attached by engine.addresses: its tokenizer at least); "" = none
    engine: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    # the judge's user message; placeholders {response} (required), {question} (the prompt's text) and {reference}
    # (the row's answer_key value)
    template: str = ""
    chat_template: bool = True  # the message as a user turn in the judge tokenizer's chat template, else plain text
    parser: str = r"(-?\d+(?:\.\d+)?)"  # a regular expression searched in the answer; group 1 is the verdict
    score_range: tuple[float, float] = (0.0, 10.0)  # a number verdict in [lo, hi] -> (v - lo) / (hi - lo)
    # label verdicts: label -> score (instead of numbers), matched exactly, else case-insensitively
    labels: dict[str, float] = dataclasses.field(default_factory=dict)
    # an answer the parser must read (checked when the recipe loads); default: each label, else the range's ends
    parser_example: str = ""
    max_new_tokens: int = 32
    timeout_s: float = 60.0  # per call
    retries: int = 1
    failure_score: float = 0.0
    concurrency: int = 16  # calls in flight
    weight: float = 1.0
    # the judge's scores of a batch: fn(judge, prompts, responses, answers) -> list[float | None] (None: no
    # verdict), "package.module:function"; `judge` (rewards/judge.Judge) has .ask(messages) and .verdict(text)
    function: str = "rlhf_mc.rewards.judge:judge_scores"

    def __post_init__(self):
        import re
        import string

        _served_engine("judge", self.engine, (("max_concurrency", "concurrency"),
                                                    ("request_timeout_s", "timeout_s")))
        check_at_least(self, 1, "max_new_tokens", "concurrency")
        check_at_least(self, 0, "retries")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if not self.enabled:
            given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != (
                f.default if f.default is not dataclasses.MISSING else f.default_factory())]
            if given:
                raise ConfigError(f"path: judge settings {given} without a judge: give judge.path (an HF checkpoint: "
                                  "what a launched engine serves; with engine.addresses, the served model's tokenizer)")
            return
        fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        if "response" not in fields:
            raise ConfigError(f"template: {self.template!r} has no {{response}} placeholder: the judge would never "
                              "see the response")
        if fields - {"response", "question", "reference"}:
            raise ConfigError(f"template: unknown placeholders {sorted(fields - {'response', 'question', 'reference'})}"
                              " (known: response, question, reference)")
        try:
            pattern = re.compile(self.parser)
        except re.error as e:
            raise ConfigError(f"parser: {self.parser!r} is not a regular expression ({e})") from None
        if pattern.groups != 1:
            raise ConfigError(f"parser: {self.parser!r} has {pattern.groups} groups; one group holds the verdict")
        if len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]:
            raise ConfigError(f"score_range: needs [lo, hi] with lo < hi, got {list(self.score_range)}")
        lo, hi = self.score_range
        examples = [self.parser_example] if self.parser_example else (
            [str(k) for k in self.labels] or [f"{lo:g}", f"{hi:g}"])
        for example in examples:
            match = pattern.search(example)
            if match is None or self.verdict(match.group(1)) is None:
                raise ConfigError(f"parser: {self.parser!r} reads no verdict from {example!r}"
                                  f"{' (judge.labels: ' + str(sorted(self.labels)) + ')' if self.labels else ''}; "
                                  "fix the expression, or set judge.parser_example to an answer it must read")

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def verdict(self, text: str) -> float | None:
        """The score of a verdict the parser read: its label's, or the number mapped from score_range to [0, 1];
        None if it is neither."""
        if self.labels:  # exactly, else case-insensitively
            text = text.strip()
            value = self.labels.get(text, {k.lower(): v for k, v in self.labels.items()}.get(text.lower()))
            return None if value is None else float(value)
        try:
            number = float(text)
        except ValueError:
            return None
        lo, hi = self.score_range
        return (number - lo) / (hi - lo) if lo <= number <= hi else None


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised fine-tuning on prompt/response rows; in an RL recipe a first stage that runs when the run has no
    checkpoint yet (the warm start)."""

    data_path: str = ""  # jsonl/parquet with prompt_key and response_key (or messages_key); empty = no SFT stage
    only: bool = False  # an SFT job: stop after the SFT stage (its model is <output_dir>/init_hf)
    response_key: str = "response"
    # rows are conversations (chat messages, tool calls and results included) under this key, trained on their
    # assistant turns, tokenized as the multi-turn rollouts hold them (data/chat.py); needs data.chat_template
    messages_key: str = ""
    steps: int = 0
    batch_size: int = 32  # sequences per step
    optim: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    micro_batch_tokens: int = 8192

    def __post_init__(self):
        check_at_least(self, 1, "batch_size", "micro_batch_tokens")
        if self.data_path and self.steps < 1:
            raise ConfigError(f"steps: must be >= 1 with sft.data_path set, got {self.steps}")
        if self.only and not self.data_path:
            raise ConfigError("only: an SFT-only job needs sft.data_path")


@dataclasses.dataclass(frozen=True)
class ResourcesSection:
    nodes: int = 1
    devices_per_node: int = 1  # GPUs per node; on a machine without GPUs, processes (each given one CPU by Ray)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # one GPU's memory, for the plan's memory estimate (trainer/memory.py); 0: this machine's first GPU, if any
    gpu_memory_gib: float = 0.0

    def __post_init__(self):
        check_at_least(self, 1, "nodes", "devices_per_node")
        if self.gpu_memory_gib < 0:
            raise ConfigError(f"gpu_memory_gib: must be >= 0, got {self.gpu_memory_gib}")


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
        check_at_least(self, 1, "keep_checkpoints")
        check_at_least(self, 0, "val_interval", "save_interval")


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
    # tools the policy calls in multi-turn rollouts (rollout.function rlhf_mc.rollout.multi_turn:tool_loop); their
    # schemas go into the prompts' and SFT conversations' chat template
    tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)
    teacher: TeacherSection = dataclasses.field(default_factory=TeacherSection)  # on-policy distillation
    judge: JudgeSection = dataclasses.field(default_factory=JudgeSection)  # a generative reward

    def __post_init__(self):
        if not (self.reward.function or self.reward.model or self.judge.enabled):
            raise ConfigError("reward.function: no reward: give reward.function, reward.model, a judge or several")
        if self.algorithm.estimator == "distill" and not self.teacher.path:
            raise ConfigError("algorithm.estimator: distill learns from a teacher: set teacher.path")
        if self.tools != ToolsConfig() and not self.tools.functions:
            raise ConfigError("tools: settings given but no tools.functions")
        if self.tools.functions and not self.data.chat_template:
            raise ConfigError("tools.functions: tool calls and results are chat messages; set data.chat_template=true")
        if self.rollout.ignore_eos and self.tools.functions:
            raise ConfigError("rollout.ignore_eos: a multi-turn rollout's turns end at EOS; leave it out with "
                              "tools.functions")
        if self.sft.messages_key and not self.data.chat_template:
            raise ConfigError(f"sft.messages_key: {self.sft.messages_key!r}: conversations are tokenized through the "
                              "chat template; set data.chat_template=true")
        if self.rollout.mode == "async" and self.algorithm.dynamic_sampling_max_rounds:
            raise ConfigError(f"algorithm.dynamic_sampling_max_rounds: {self.algorithm.dynamic_sampling_max_rounds}"
                              " with rollout.mode=async: the stream admits a fixed number of groups per step and "
                              "drops none; use mode sync or one_step_off for dynamic sampling")
        # One section type serves the actor and the critic: each reads only its own loss fields.
        if self.critic.loss != PolicyLossConfig():
            raise ConfigError("critic.loss: the critic's loss is the clipped value loss (critic.value_clip); the "
                              "policy loss is actor.loss")
        if self.critic.lora != LoraConfig():
            raise ConfigError("critic.lora: LoRA adapts the actor (actor.lora); the critic trains in full")
        if self.actor.lora.enabled and self.ref.placement == "separate":
            raise ConfigError("ref.placement: separate, with actor.lora on: the reference is the actor's base with "
                              "the adapters off (no second model); leave ref.placement at host")
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
        the reward needs them before the advantages, so it keeps the forward, and so do a teacher's advantage and
        an off-policy mode (its samples come from older weights than the ones trained)."""
        actor = self.actor
        return (self.rollout.mode == "sync" and self.algorithm.skip_on_policy_old_logprobs and actor.ppo_epochs == 1
                and actor.ppo_mini_batch_size in (0, self.data.train_batch_size)
                and self.algorithm.kl_in_reward_coef == 0 and not self.teacher.path)


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


# the recipe's file and directory paths, resolved once when it loads
PATHS = {"model": ("path", "config", "tokenizer"), "data": ("train_path", "val_path"), "sft": ("data_path",),
         "reward": ("model",), "teacher": ("path",), "judge": ("path",)}


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """The recipe at `path` with `overrides`, checked; its paths resolved (resolve_path) and the derived defaults
    filled in (seq-mean-token-sum-norm's divisor: data.max_response_length)."""
    recipe = from_dict(Recipe, apply_overrides(load_yaml(path), list(overrides)))
    changes = {section: {f: str(resolve_path(v)) for f in fields if (v := getattr(getattr(recipe, section), f))}
               for section, fields in PATHS.items()}
    loss, lora = recipe.actor.loss, recipe.actor.lora
    changes["actor"] = {}
    if loss.aggregation == "seq-mean-token-sum-norm" and not loss.norm_length:
        changes["actor"]["loss"] = dataclasses.replace(loss, norm_length=recipe.data.max_response_length)
    if lora.adapter_path:
        changes["actor"]["lora"] = dataclasses.replace(lora, adapter_path=str(resolve_path(lora.adapter_path)))
    return dataclasses.replace(recipe, **{s: dataclasses.replace(getattr(recipe, s), **c) for s, c in changes.items()})


def model_config(recipe: Recipe) -> ModelConfig:
    """The architecture: from model.config when given, else from the HF checkpoint's config.json."""
    if recipe.model.config:
        path = Path(recipe.model.config)
        if not path.is_file():
            raise ConfigError(f"model.config: file not found: {recipe.model.config}")
        return ModelConfig.from_yaml(path)
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config

    path = Path(recipe.model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: no HF checkpoint (config.json) at {recipe.model.path}")
    try:
        return model_config_from_hf(read_hf_config(path))
    except ConfigError as e:
        raise ConfigError(f"model.path: {path}: {e}") from None


def to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)
