"""The RL loop, single controller (DESIGN.md, "One training step"): rollout -> rewards -> old / reference log-probs
(-> values) -> advantages -> actor (and critic) update -> weight sync, every phase timed; validation, checkpoints
and logging around it. An optional SFT stage warms the actor up first."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import random
import shutil
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from rlhf_mc.algorithms import core
from rlhf_mc.bridge.adapters import write_peft_adapter
from rlhf_mc.bridge.hf_config import hf_config_from_model, model_config_from_hf, read_hf_config
from rlhf_mc.config import RolloutConfig, RouterConfig, import_by_path
from rlhf_mc.data.dataset import Prompt, batch_for_step, load_prompts, load_sft
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.models.lora import zero_adapter
from rlhf_mc.rewards.judge import Judge
from rlhf_mc.rewards.scoring import RewardScorer
from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.rollout.sglang_engine import SGLangEngine
from rlhf_mc.tools.executor import tool_schema
from rlhf_mc.trainer import checkpoints
from rlhf_mc.trainer.colocation import ColocationSchedule
from rlhf_mc.trainer.metrics import MetricsLogger, Timer
from rlhf_mc.trainer.placement import Cluster
from rlhf_mc.trainer.rollouts import RolloutManager
from rlhf_mc.trainer.stream import RolloutStream
from rlhf_mc.trainer.teacher import MegatronTeacher, ServedTeacher, distillation_metrics
from rlhf_mc.trainer.plan import Plan
from rlhf_mc.trainer.recipe import Recipe, model_config, to_dict

log = logging.getLogger("rlhf_mc.trainer")


@dataclasses.dataclass
class Stop:
    """A stop asked for by a signal (tools/launch.py). Within the SFT or RL steps the step under way finishes and is
    logged first; elsewhere (start-up, checkpoint loading, the final export), and on a second request, at once."""

    asked: threading.Event = dataclasses.field(default_factory=threading.Event)
    in_steps: bool = False

    def request(self) -> bool:
        """Records the request; True when the caller must stop at once."""
        again = self.asked.is_set()
        self.asked.set()
        return again or not self.in_steps

    def __call__(self) -> bool:
        return self.asked.is_set()


def advantages(recipe: Recipe, batch: Trajectories, kl_coef: float = 0.0
               ) -> tuple[dict[str, torch.Tensor], float | None]:
    """Per token: "advantages" (and "returns" for GAE), from the scores and the per-token fields, plus the
    teacher's distillation advantage when the batch has its log-probs; with the KL in the reward at `kl_coef`, also
    the batch's KL as verl's KL controller reads it (the mean over sequences of each one's token-mean KL), else
    None."""
    algo, mask = recipe.algorithm, batch.padded().bool()
    s, g = batch.scores, batch.groups
    token_rewards = core.token_rewards_with_kl(s, torch.zeros(mask.shape), mask, 0.0)
    current_kl = None
    if algo.kl_in_reward_coef > 0:
        kl = core.kl_penalty(batch.padded(batch.fields["old_logprobs"]), batch.padded(batch.fields["ref_logprobs"]),
                             algo.kl_in_reward_estimator)
        current_kl = core.masked_mean(kl, mask, dim=-1).mean().item()
        token_rewards = core.token_rewards_with_kl(s, kl, mask, kl_coef)
        # The outcome estimators take a sequence's summed token rewards as its score (verl's): score - coef * KL.
        s = core.masked_sum(token_rewards, mask, dim=-1)
    out = {}
    if algo.estimator == "distill":  # the teacher's advantage alone (added below)
        adv = torch.zeros(mask.shape)
    elif algo.estimator == "grpo":
        adv = core.grpo_advantages(s, g, mask, algo.norm_by_std)
    elif algo.estimator == "rloo":
        adv = core.rloo_advantages(s, g, mask)
    elif algo.estimator == "reinforce_pp":
        adv = core.reinforce_pp_advantages(token_rewards, mask, algo.gamma)
    elif algo.estimator == "reinforce_pp_baseline":
        adv = core.reinforce_pp_baseline_advantages(s, g, mask)
    else:
        adv, returns = core.gae_advantages(token_rewards, batch.padded(batch.fields["values"]), mask, algo.gamma,
                                           algo.lam)
        out["returns"] = batch.unpadded(returns)
    if "teacher_logprobs" in batch.fields:
        adv = adv + core.distillation_advantages(batch.padded(batch.fields["old_logprobs"]),
                                                 batch.padded(batch.fields["teacher_logprobs"]), mask,
                                                 recipe.teacher.kl_coef)
    out["advantages"] = batch.unpadded(adv)
    return out, current_kl


def tool_schemas(recipe: Recipe) -> list[dict] | None:
    """The recipe's tools as the chat template takes them (None without tools: the template renders none)."""
    return [tool_schema(path) for path in recipe.tools.functions] or None


def _hf_config(recipe: Recipe, model, tokenizer) -> dict:
    """config.json for the actor's HF exports: the source's when the model came from HF, else made from the model
    config with the tokenizer's special tokens (SGLang stops at the config's eos_token_id)."""
    if recipe.model.path:
        return read_hf_config(recipe.model.path)
    config = hf_config_from_model(model, recipe.model.dtype)
    config.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    return config


def _config_only(out: Path, hf_config: dict) -> str:
    """A directory with `hf_config` as its config.json alone: what engines with random weights start from."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    return str(out)


def run_sft(recipe: Recipe, cluster: Cluster, model, tokenizer, out: Path, hf_config: dict, tokenizer_dir: str,
            logger: MetricsLogger, stop: Stop) -> bool:
    """SFT on recipe.sft.data_path from the initial weights (the RL warm start, or the whole job with sft.only);
    the result exported to `out` (HF). False if `stop` ended it first (nothing exported)."""
    sft, data = recipe.sft, recipe.data
    examples = load_sft(sft.data_path, tokenizer, data.prompt_key, sft.response_key, data.chat_template,
                        data.max_prompt_length + data.max_response_length, sft.messages_key, tool_schemas(recipe))
    group = cluster.worker_group("sft", model, recipe.actor.parallel, recompute=recipe.actor.recompute,
                                 router=recipe.actor.router)
    if recipe.model.path:
        group.load_hf(recipe.model.path)
    group.setup_optimizer(sft.optim)
    logger.phase("sft")
    rng = random.Random(recipe.trainer.seed)
    stop.in_steps = True
    with tqdm(total=sft.steps, desc="sft", dynamic_ncols=True, disable="console" not in recipe.trainer.loggers) as bar:
        for step in range(sft.steps):
            batch = [examples[rng.randrange(len(examples))] for _ in range(sft.batch_size)]
            sequences = Trajectories.from_rows([ids for ids, _ in batch], [mask for _, mask in batch])
            metrics = group.train_sft(sequences, sft.micro_batch_tokens)
            logger.log(step, {f"sft/{k}": v for k, v in metrics.items()})
            bar.set_postfix(loss=f"{metrics['sft_loss']:.3g}", refresh=False)
            bar.update(1)
            if stop():
                log.warning("SFT stopped at step %d, as asked", step)
                return False
    stop.in_steps = False
    group.export_hf(str(out), hf_config, tokenizer_dir)
    group.shutdown()
    return True


def train(recipe: Recipe, plan: Plan, address: str | None = None, stop: Stop | None = None) -> dict:
    """Runs the recipe; returns the last step's metrics. `stop()`: the run ends after the step under way (logged; a
    relaunch continues from the last checkpoint)."""
    from transformers import AutoTokenizer

    run_dir = Path(recipe.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(json.dumps(to_dict(recipe), indent=1, default=str))
    model = model_config(recipe)
    tokenizer_dir = recipe.model.tokenizer or recipe.model.path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data, r = recipe.data, recipe.rollout
    train_prompts, dropped, val_prompts, total_steps = [], 0, [], 0
    if not recipe.sft.only:
        tools = tool_schemas(recipe)
        train_prompts, dropped = load_prompts(data.train_path, tokenizer, data.prompt_key,
                                              data.answer_key, data.chat_template, data.max_prompt_length, tools)
        val_prompts = load_prompts(data.val_path, tokenizer, data.prompt_key, data.answer_key,
                                   data.chat_template, data.max_prompt_length, tools)[0] if data.val_path else []
        val_prompts = val_prompts[:data.val_size] if data.val_size else val_prompts
        per_epoch = len(train_prompts) // data.train_batch_size
        total_steps = recipe.trainer.total_steps or per_epoch * recipe.trainer.total_epochs
    scorer = RewardScorer(recipe.reward.function, recipe.reward.kwargs, recipe.reward.timeout_s,
                          recipe.reward.failure_score, recipe.reward.workers) if recipe.reward.function else None
    for path in checkpoints.remove_incomplete(run_dir):
        log.warning("removed %s: an incomplete checkpoint (the run was stopped while writing it)", path)
    resume = checkpoints.resume_from(run_dir, recipe.trainer.resume)
    trainer_state = json.loads((resume / "trainer_state.json").read_text()) if resume else {"step": 0}
    logger = MetricsLogger(run_dir, recipe.trainer.loggers, total_steps, trainer_state["step"], to_dict(recipe),
                           recipe.trainer.project, recipe.trainer.experiment)
    stop = stop or Stop()
    logger.phase("start ray")
    cluster = Cluster(recipe, plan, address)
    try:
        nodes = cluster.bundle_nodes()
        (run_dir / "placement.json").write_text(json.dumps(
            [{**row, "bundle": i, "ray_node": nodes[i]} for i, row in enumerate(plan.placement)], indent=1))
        # The initial weights, an HF checkpoint: the source's, the SFT stage's, or the actor's random init.
        hf_config = _hf_config(recipe, model, tokenizer)
        init_hf = run_dir / "init_hf"
        # weights that exist before this launch's SFT stage and workers (None: made by them)
        start_from = str(init_hf) if init_hf.is_dir() else None if recipe.sft.data_path else recipe.model.path or None
        if not recipe.sft.only:
            # The engines start first and at once (~30-40 s of SGLang's imports on a CPU): beside the SFT stage and
            # the workers, from the weights when they exist, else from the config with random weights, which the
            # step-0 sync replaces (every run syncs before its first rollout).
            logger.phase("start engines")
            engine_from = start_from or _config_only(run_dir / "engine_config", hf_config)
            lora_adapter = ""
            if plan.sync_transport == "adapter":  # the engines serve the base plus an adapter the syncs replace
                lora_adapter = str(run_dir / "engine_adapter")
                write_peft_adapter(lora_adapter, zero_adapter(model, recipe.actor.lora), recipe.actor.lora,
                                   str(engine_from))
            cluster.launch_engines(engine_from, run_dir / "logs", routed_experts=bool(model.num_experts),
                                   random_weights=start_from is None, lora_adapter=lora_adapter)
            if recipe.teacher.path and recipe.teacher.backend == "engine":
                cluster.serve("teacher", recipe.teacher.path, recipe.teacher.engine, run_dir / "logs")
            if recipe.judge.enabled:
                cluster.serve("judge", recipe.judge.path, recipe.judge.engine, run_dir / "logs")
            if plan.engines_release_memory:
                # GPUs shared with the trainer: the engines take their memory and give it back before any worker
                # allocates
                cluster.engine_addresses()
                cluster.engines_call("release_memory")
        if start_from is None and recipe.sft.data_path:
            if not run_sft(recipe, cluster, model, tokenizer, init_hf, hf_config, tokenizer_dir, logger, stop):
                return logger.last
        if recipe.sft.only:
            return logger.last
        logger.phase("start workers")
        lora = recipe.actor.lora
        actor = cluster.worker_group("actor", model, recipe.actor.parallel, recompute=recipe.actor.recompute,
                                     router=recipe.actor.router, lora=lora)
        if not init_hf.is_dir() and not recipe.model.path:  # random init: the actor's, for the roles that load it
            actor.export_hf(str(init_hf), hf_config, tokenizer_dir)
        init_hf = init_hf if init_hf.is_dir() else Path(recipe.model.path)
        reference = actor
        if recipe.uses_reference and recipe.ref.placement == "separate":
            # routing replay as the actor's, in the reference's forward passes too
            reference = cluster.worker_group("ref", model, recipe.ref.parallel,
                                             router=RouterConfig(replay=recipe.actor.router.replay))
        critic = None
        if recipe.uses_critic:
            critic = cluster.worker_group("critic", model, recipe.critic.parallel, value_head=True,
                                          recompute=recipe.critic.recompute, router=recipe.critic.router)
        teacher_group = None
        if recipe.teacher.path and recipe.teacher.backend == "megatron":
            teacher_group = cluster.worker_group("teacher", model_config_from_hf(read_hf_config(recipe.teacher.path)),
                                                 recipe.teacher.parallel)
        offloaded = [group for group, on in ((critic, recipe.critic.offload), (reference, recipe.ref.offload),
                                             (teacher_group, recipe.teacher.offload))
                     if group is not None and group is not actor and on]
        schedule = ColocationSchedule(cluster, actor, recipe.actor.offload, offloaded, plan.colocated,
                                      plan.engines_release_memory)
        logger.phase("load weights")
        actor.load_hf(str(init_hf))
        if lora.adapter_path:
            actor.load_adapter(lora.adapter_path)
        if recipe.uses_reference and not lora.enabled:  # with LoRA: the base, adapters off
            actor.keep_reference()
        actor.setup_optimizer(recipe.actor.optim)
        if reference is not actor:
            reference.load_hf(str(init_hf))
        if teacher_group:
            teacher_group.load_hf(recipe.teacher.path)
        if critic:
            critic.load_hf(str(init_hf))  # the value head starts from its own init
            critic.setup_optimizer(recipe.critic.optim)
        if resume:
            trainer_state = actor.load(str(resume))
            if critic:
                critic.load(str(checkpoints.critic_dir(resume)))
            log.info("resumed from %s at step %d", resume, trainer_state["step"])
        logger.phase("wait for engines")
        actor.prepare_sync()  # while the engines start
        # the disk transport's staging in the run folder: on a cluster, the filesystem the engines share
        actor.connect_engines(cluster.engine_addresses(), plan.sync_transport, r.sync_bucket_mb * 2**20,
                              cluster.engine_ranks(), str(init_hf), str(run_dir / "sync_staging"))
        reward_model = None
        if recipe.reward.model:
            reward_path = recipe.reward.model
            reward_model = cluster.worker_group("reward", model_config_from_hf(read_hf_config(reward_path)),
                                                recipe.reward.parallel, value_head=True)
            reward_model.load_hf(reward_path, "score.weight")
        teacher = _teacher(recipe, cluster, teacher_group)
        judge = Judge(recipe.judge, cluster.served_addresses("judge"),
                      AutoTokenizer.from_pretrained(recipe.judge.path)) if recipe.judge.enabled else None
        rollouts = RolloutManager(recipe, cluster, schedule, tokenizer, scorer, reward_model, judge)
        try:
            metrics = _run_steps(recipe, cluster, schedule, rollouts, actor, reference, critic, teacher, tokenizer,
                                 train_prompts, val_prompts, trainer_state, total_steps, logger, run_dir, dropped, stop)
        finally:
            rollouts.close()
        if stop():
            return metrics
        schedule.finish()
        if recipe.trainer.export_hf:
            logger.phase("export")
            if lora.enabled:
                actor.export_adapter(str(run_dir / "final_adapter"), str(init_hf))
            if not lora.enabled or lora.export_merged:
                shutil.rmtree(run_dir / "final_hf", ignore_errors=True)
                actor.export_hf(str(run_dir / "final_hf"), hf_config, tokenizer_dir)
        return metrics
    finally:
        logger.close()
        cluster.shutdown()


def _teacher(recipe: Recipe, cluster: Cluster, group):
    """The teacher's handle (trainer/teacher.py), None without one: its Megatron worker `group`, or a client of
    its served engines."""
    t = recipe.teacher
    if not t.path:
        return None
    if t.backend == "megatron":
        return MegatronTeacher(group, t.micro_batch_tokens)
    addresses = tuple(cluster.served_addresses("teacher"))
    return ServedTeacher(SGLangEngine(RolloutConfig(addresses=addresses, num_engines=len(addresses),
                                                    max_concurrency=t.engine.max_concurrency,
                                                    request_timeout_s=t.engine.request_timeout_s)))


def _run_steps(recipe: Recipe, cluster: Cluster, schedule: ColocationSchedule, rollouts: RolloutManager, actor,
               reference, critic, teacher, tokenizer, train_prompts: list[Prompt], val_prompts: list[Prompt],
               trainer_state: dict, total_steps: int, logger: MetricsLogger, run_dir: Path, dropped: int,
               stop: Stop) -> dict:
    data, r, trainer, algo = recipe.data, recipe.rollout, recipe.trainer, recipe.algorithm
    # the KL-in-reward coefficient: fixed, or the adaptive controller's, carried through checkpoints
    step, kl_coef = trainer_state["step"], trainer_state.get("kl_coef", algo.kl_in_reward_coef)
    sampling = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=data.max_response_length, stop_token_ids=(tokenizer.eos_token_id,),
                              ignore_eos=r.ignore_eos)
    temperature = r.temperature or 1.0  # greedy samples' log-probs are under softmax(logits) (rollout/base.py)
    micro, critic_micro = recipe.actor.micro_batch_tokens, recipe.critic.micro_batch_tokens
    mini_batches = data.train_batch_size // (recipe.actor.ppo_mini_batch_size or data.train_batch_size)
    critic_mini_batches = data.train_batch_size // (recipe.critic.ppo_mini_batch_size or data.train_batch_size)
    # the reference's own worker group, or its weights swapped into the actor's modules
    ref_logprobs = reference.logprobs if reference is not actor else actor.ref_logprobs
    teacher_function = import_by_path("teacher.function", recipe.teacher.function) if teacher else None
    schedule.before_rollout(step, Timer(logger.phase))  # the engines hold the actor's weights, version = step
    timer, metrics = Timer(logger.phase), {}
    stop.in_steps = True
    if val_prompts and step == 0:
        logger.log(0, rollouts.validate(val_prompts))
    # The rollouts run in their own thread: in one_step_off mode the next step's overlaps this step's training (on
    # the weights the engines hold); in sync mode each one is awaited as soon as it starts. In async mode groups
    # stream in under the staleness bound (trainer/stream.py). A rollout still under way when the run stops is
    # dropped: a resumed run generates that step's batch again, with its own weights.
    rollout_thread = ThreadPoolExecutor(1, thread_name_prefix="rollout")
    busy: list[tuple[float, float]] = []  # when the engines generated (the rollouts' start and end)

    def step_prompts(for_step: int) -> list[Prompt]:
        rows = batch_for_step(len(train_prompts), data.train_batch_size, for_step, trainer.seed, data.shuffle)[1]
        return [train_prompts[i] for i in rows]

    def start_rollout(for_step: int) -> Future:
        more_prompts = functools.partial(_more_prompts, train_prompts, data.train_batch_size, trainer.seed, for_step)

        def rollout():
            times, start = Timer(logger.phase), time.perf_counter()
            batch, stats = rollouts.sample(step_prompts(for_step), sampling, for_step, more_prompts, times)
            busy.append((start, time.perf_counter()))
            return batch, stats, times.times

        return rollout_thread.submit(rollout)

    stream = None
    if r.mode == "async":
        stream = RolloutStream(rollouts.rollout, step_prompts, sampling, data.train_batch_size, r.staleness_bound,
                               step, total_steps)
        stream.weights_updated(step)

    def streamed(for_step: int) -> tuple:
        prompts, samples, span = stream.take(for_step)
        times = Timer(logger.phase)
        batch, stats = rollouts.sample(prompts, sampling, for_step, None, times, samples)
        return batch, stats, {**times.times, "timing/rollout_s": span}

    pending = None
    while step < total_steps:
        started = time.perf_counter()
        epoch = batch_for_step(len(train_prompts), data.train_batch_size, step, trainer.seed, data.shuffle)[0]
        with timer("step"):
            if stream is None:
                pending = pending or start_rollout(step)
            with timer("wait_rollout"):
                batch, sample_stats, rollout_times = streamed(step) if stream else pending.result()
            pending = start_rollout(step + 1) if r.mode == "one_step_off" and step + 1 < total_steps else None
            # the actor's calls, here and when a restarted engine is restored from the rollouts' thread, one at a time
            with schedule.actor_in_use():
                schedule.after_rollout(timer)
                entropy = None
                if not recipe.old_logprobs_from_update:
                    with timer("old_logprob"):
                        out = actor.logprobs(batch, temperature, micro, with_entropy=True)
                        batch, entropy = batch.with_fields(old_logprobs=out["logprobs"]), out["entropy"]
                if recipe.uses_reference:
                    with timer("ref_logprob"):
                        batch = batch.with_fields(ref_logprobs=ref_logprobs(batch, temperature, micro)["logprobs"])
                if teacher is not None:
                    with timer("teacher_logprob"):
                        batch = batch.with_fields(teacher_logprobs=teacher_function(teacher, batch).float())
                if critic:
                    with timer("values"):
                        values = critic.values(batch, critic_micro)["values"]
                        batch = batch.with_fields(values=values, old_values=values)
                with timer("advantages"):
                    fields, current_kl = advantages(recipe, batch, kl_coef)
                    batch = batch.with_fields(**fields)
                kl_metrics = {}
                if current_kl is not None:
                    kl_metrics = {"algorithm/kl_coef": kl_coef, "algorithm/kl_in_reward": current_kl}
                    if algo.kl_target > 0:
                        kl_coef = core.adaptive_kl_coef(kl_coef, current_kl, algo.kl_target, algo.kl_horizon,
                                                        len(batch))
                with timer("update_actor"):
                    actor_metrics = actor.train_policy(batch, mini_batches, recipe.actor.ppo_epochs, recipe.actor.loss,
                                                       temperature, micro)
                critic_metrics = {}
                if critic:
                    with timer("update_critic"):
                        critic_metrics = critic.train_values(batch, critic_mini_batches, recipe.critic.ppo_epochs,
                                                             recipe.actor.loss, critic_micro, recipe.critic.value_clip)
                step += 1
                if (trainer.save_interval and step % trainer.save_interval == 0) or step == total_steps:
                    with timer("save"):
                        _save(actor, critic, run_dir, {"step": step, "kl_coef": kl_coef}, trainer.keep_checkpoints)
                schedule.actor_trained(step)
            if pending is not None:  # the engines end the next step's rollout on the weights they hold, then sync
                with timer("wait_rollout"):
                    futures.wait([pending])
            with schedule.actor_in_use():
                sync_metrics = schedule.before_rollout(step, timer)
            if stream is not None:
                stream.weights_updated(step)
        metrics = _step_metrics(batch, entropy, sample_stats, actor_metrics, critic_metrics, epoch, dropped,
                                recipe.reward.correct_score)
        if teacher is not None:
            metrics.update(distillation_metrics(batch))
        metrics.update(sync_metrics, **kl_metrics, **timer.times, **rollout_times,
                       **_idle(timer.times, stream.busy_since(started) if stream else busy, started,
                               time.perf_counter()),
                       **{f"rollout/{k}": v for k, v in cluster.engine_stats().items()})
        timer = Timer(logger.phase)
        if val_prompts and ((trainer.val_interval and step % trainer.val_interval == 0) or step == total_steps):
            metrics.update(rollouts.validate(val_prompts))
        logger.log(step, metrics)
        logger.advance()
        if stop():
            log.warning("stopped after step %d, as asked", step)
            break
    rollout_thread.shutdown(wait=False)
    if stream is not None:
        stream.close()
    stop.in_steps = False
    return metrics


def _idle(times: dict[str, float], busy: list[tuple[float, float]], start: float, end: float) -> dict:
    """The step's idle seconds: the trainer's waiting for rollouts, and the engines' time between rollouts (the
    union of `busy`, whose spans overlap in async mode)."""
    generating, reached = 0.0, start
    for a, b in sorted(busy):
        a, b = max(a, reached), min(b, end)
        generating += max(0.0, b - a)
        reached = max(reached, b)
    return {"idle/trainer_s": times["timing/wait_rollout_s"], "idle/engines_s": max(0.0, end - start - generating)}


def _more_prompts(prompts: list[Prompt], size: int, seed: int, step: int, round_: int) -> list[Prompt]:
    """Dynamic sampling's further rounds of a step: prompts drawn at random (reproducibly)."""
    rng = random.Random(f"{seed}-{step}-{round_}")
    return [prompts[i] for i in rng.sample(range(len(prompts)), size)]


def _save(actor, critic, run_dir: Path, trainer_state: dict, keep: int) -> None:
    path = checkpoints.checkpoint_dir(run_dir, trainer_state["step"])
    if path.exists():
        return
    if critic:  # first: the actor's trainer_state.json marks the checkpoint complete
        critic.save(str(checkpoints.critic_dir(path)))
    actor.save(str(path), trainer_state)
    checkpoints.prune(run_dir, keep)


def _old_policy_metrics(batch: Trajectories, entropy: torch.Tensor | None, actor_metrics: dict) -> dict:
    """Rollout vs trainer log-probs of the same tokens (near 0 when engine and actor agree), the entropy and the KL
    to the reference: from the old-log-prob pass, or reported by an on-policy update that stood in for it."""
    if entropy is None:
        names = {"rollout_logprob_diff": "rollout/logprob_diff", "token_entropy": "actor/entropy",
                 "kl_ref": "actor/kl_ref"}
        return {names[k]: actor_metrics.pop(k) for k in list(actor_metrics) if k in names}
    mask, fields = batch.loss_mask, batch.fields
    old = fields["old_logprobs"][mask]
    out = {"actor/entropy": entropy[mask].mean().item(),
           "rollout/logprob_diff": (old - fields["rollout_logprobs"][mask]).abs().mean().item()}
    if "ref_logprobs" in fields:
        out["actor/kl_ref"] = core.kl_penalty(old, fields["ref_logprobs"][mask], "k1").mean().item()
    return out


def _step_metrics(batch: Trajectories, entropy, sample_stats, actor_metrics, critic_metrics, epoch, dropped,
                  correct) -> dict:
    lengths = batch.sampled_tokens().float()
    scores = batch.scores
    out = {"reward/mean": scores.mean().item(), "reward/accuracy": (scores >= correct).float().mean().item(),
           **sample_stats, "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
           "sequence/length_mean": batch.lengths.float().mean().item(),  # prompt and response: the tokens trained
           "response/clipped_fraction": sum(f != "stop" for f in batch.finish_reasons) / len(batch),
           **_old_policy_metrics(batch, entropy, actor_metrics),
           "data/epoch": epoch, "data/prompts_dropped": dropped, "data/samples": len(batch)}
    out.update({f"actor/{k}": v for k, v in actor_metrics.items() if not (isinstance(v, float) and math.isnan(v))})
    out.update({f"critic/{k}": v for k, v in critic_metrics.items()})
    return out
