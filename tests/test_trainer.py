"""The trainer end to end through tools/launch.py (Ray, Megatron workers, an SGLang engine, the SFT warm start).

Crash and stop handling, in one sequence of launches that share a run directory:
- an uninterrupted run whose SGLang server is killed in the middle of a rollout: the engine is restarted, given the
  actor's current weights before its lost requests are retried, and the run completes (every sample's version is
  checked by the trainer, which would stop otherwise);
- a second run killed with SIGKILL (its whole session) while it writes its step-4 checkpoint; relaunched, the
  partial checkpoint is removed and the run resumes from step 2 to the end (a stop by SIGINT or SIGTERM, which
  finishes the step under way, is tests/test_shutdown.py's);
- the deterministic metrics of the steps after the checkpoint equal the uninterrupted run's exactly.

Rollouts are greedy (temperature 0) because SGLang honours sampling seeds only on GPU backends (rollout/base.py);
REINFORCE++ with one sample per prompt still gives non-zero advantages, so the weights move every step. The engine
takes one sample at a time (rollout.engine.max_concurrency=1: requests of one sample, one after another): which
samples share a batch otherwise depends on how they reach the server (a killed server's retried samples), and a row
of a matmul changes in its last bits with the batch's row count (MKL, measured here), enough to flip a greedy token
now and then (CI saw it at step 3 once)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from rlhf_mc.runtime.spawn import free_port
from tests.conftest import ray_env

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
# One device slot (one trainer rank, one engine) wherever a test needs no more: each engine and rank is a process
# start of seconds. The two-engine test runs DP=2.
ONE_SLOT = ["resources.devices_per_node=1", "rollout.engine.num_engines=1"]
ARGS = ["recipes/quickstart.yaml", "sft.data_path=", f"trainer.total_steps={STEPS}", *ONE_SLOT,
        "trainer.save_interval=2", "trainer.val_interval=3", "data.val_size=16", "data.train_batch_size=8",
        "rollout.n=1", "rollout.temperature=0", "rollout.val_n=1", "rollout.engine.max_concurrency=1",
        "algorithm.estimator=reinforce_pp", "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-3",
        "trainer.loggers=[jsonl]", "reward.function=tests.test_trainer:char_codes"]
# Not deterministic: times, memory, and what depends on the engine's batching (its log-probs of the same greedy
# tokens, computed in batches of other sizes after a restart) or on the restarts themselves.
VOLATILE = ("timing/", "idle/", "sync/seconds", "sync/peak_extra_mb", "rollout/logprob_diff",
            "rollout/engine_restarts", "rollout/request_retries")


def char_codes(response: str, answer: str, prompt: str) -> float:
    """A reward (imported by path) that differs between almost any two different responses, and between prompts: a
    short run from a random model gets non-zero advantages at every step (a shaped reward such as the share of the
    answer's digits in place ties at 0 for most responses of such a model, and the gradient is 0). The prompt's
    part keeps batch-normalized estimators (REINFORCE++ with one sample a prompt) moving after the policy collapses
    to one response for every prompt (seen at lr 1e-3 by step 5); group-relative ones cancel it."""
    return (sum(map(ord, response)) + sum(map(ord, prompt)) % 97) / 1000


def char_code_parity(response: str, answer: str, prompt: str) -> float:
    """A reward on which about half of the groups of two samples tie: dynamic sampling has groups to drop."""
    return float(sum(map(ord, response)) % 2)


def _start(out: Path, args: list[str] = ARGS, ray_address: str | None = None) -> subprocess.Popen:
    """The launcher writing to <out>.log (not to a pipe, which a process left behind would hold open); on its own
    local Ray instance, or joining the node at `ray_address` (conftest.ray_address)."""
    log = open(out.with_suffix(".log"), "ab")
    join = ["--address", ray_address] if ray_address else []
    return subprocess.Popen([sys.executable, "tools/launch.py", *args, *join, f"trainer.output_dir={out}"], cwd=REPO,
                            env=ray_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, out: Path) -> None:
    assert proc.wait(timeout=900) == 0, out.with_suffix(".log").read_text()[-4000:]


def _run_processes(out: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]


def _kill_run(proc: subprocess.Popen, out: Path) -> None:
    """The whole run crashing at one instant: every process the launcher started (driver, Ray, workers) is stopped,
    then SIGKILLed, then anything still serving this run. Each Ray worker has a process group of its own (killing
    the launcher's group leaves them to exit once they notice the raylet gone): one that outlived the kill by a
    moment once finished the checkpoint it was writing."""
    launcher = psutil.Process(proc.pid)
    stopped: list[psutil.Process] = []
    while new := [p for p in [launcher, *launcher.children(recursive=True)] if p not in stopped]:
        for p in new:  # stopped processes start no more; the next listing finds what started meanwhile
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
        stopped += new
    os.killpg(proc.pid, signal.SIGKILL)
    for p in stopped:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        left = _run_processes(out)
        if not left:
            return
        for p in left:
            p.kill()
        time.sleep(1)


def _metrics(out: Path) -> dict[int, dict]:
    """Per RL step, the last record logged for it (a resumed run logs the steps after its checkpoint again)."""
    steps = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "reward/mean" in record:
            steps[record["step"]] = {k: v for k, v in record.items() if not k.startswith(VOLATILE)}
    return steps


def _wait_for(proc: subprocess.Popen, out: Path, done, what: str, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while not done():
        assert proc.poll() is None, f"the run ended before {what}:\n" + out.with_suffix(".log").read_text()[-4000:]
        assert time.time() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)


def _kill_server_mid_rollout(proc: subprocess.Popen, out: Path) -> None:
    """Once step 1 is logged: slows the run's engine 0 down (SGLang's /slow_down: every batch sleeps, and its log
    says so), waits until it is generating, and kills its server."""
    _wait_for(proc, out, lambda: (out / "metrics.jsonl").exists() and 1 in _metrics(out), "step 1")
    log = out / "logs" / "engine0" / "sglang_engine0.log"
    _, port = _server_args(log)
    (server,) = [p for p in _run_processes(out) if "sglang.launch_server" in p.cmdline() and str(port) in p.cmdline()]
    seen = log.read_text(errors="replace").count("run_batch sleep")
    requests.post(f"http://127.0.0.1:{port}/slow_down", json={"forward_sleep_time": 0.3}, timeout=30)
    _wait_for(proc, out, lambda: log.read_text(errors="replace").count("run_batch sleep") > seen, "slowed batch")
    server.kill()


@pytest.mark.slow
def test_crash_recovery_stop_and_resume(ray_address, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = _start(straight, ARGS, ray_address)
    _kill_server_mid_rollout(proc, straight)
    _finish(proc, straight)
    log = straight.with_suffix(".log").read_text()
    assert "rollout engine 0 was restarted: giving it the actor's current weights" in log
    restarts = [json.loads(line).get("rollout/engine_restarts") for line in
                (straight / "metrics.jsonl").read_text().splitlines()]
    assert max(r for r in restarts if r is not None) == 1

    # Killed with SIGKILL (its whole session: on a local Ray instance of its own) while it writes its step-4
    # checkpoint (its second: the step-2 one is complete). A stop by signal, which finishes the step and leaves
    # nothing behind, is tests/test_shutdown.py's.
    proc = _start(resumed)
    writing = resumed / "checkpoints" / "step_000004.tmp"
    _wait_for(proc, resumed, writing.exists, "step-4 checkpoint write")
    _kill_run(proc, resumed)
    assert not (resumed / "checkpoints" / "step_000004").exists() and writing.exists()
    assert (resumed / "checkpoints" / "step_000002" / "trainer_state.json").exists()

    # Relaunched again: the partial checkpoint is removed, the run resumes from step 2 and completes.
    _finish(_start(resumed, ARGS, ray_address), resumed)
    log = resumed.with_suffix(".log").read_text()
    assert "removed" in log and "step_000004.tmp" in log
    resumed_from = [int(part.split("at step ")[1].split()[0]) for part in log.split("resumed from")[1:]]
    assert resumed_from == [2]

    a, b = _metrics(straight), _metrics(resumed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in range(3, STEPS + 1):
        assert a[step] == b[step], step
    # The weights moved: the policy-gradient steps had a gradient, and the greedy responses changed over the run.
    assert all(a[s]["actor/grad_norm"] > 0 for s in a)
    assert "val/accuracy" in a[3] and "val/accuracy" in a[STEPS]
    # Kept: the newest trainer.keep_checkpoints (2) complete checkpoints, the final HF export.
    for run in (straight, resumed):
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000004", "step_000006"]
    assert (straight / "final_hf" / "config.json").is_file() and (straight / "final_hf" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_ppo_with_critic_separate_reference_and_reward_model(ray_address, tmp_path):
    """PPO (GAE with a critic, KL in the reward with the adaptive coefficient), the reference in its own worker
    group, a learned reward model added to the rule, actor, critic and reference offloaded during rollouts: two
    steps run; at step 1 the reference equals the (reloaded) actor (KL 0), at step 2 it does not."""
    from tests.test_reward_model import write_reward_model

    out = tmp_path / "ppo"
    rm = write_reward_model(tmp_path / "rm")
    _finish(_start(out, ["recipes/quickstart.yaml", "sft.data_path=", "trainer.total_steps=2",
                         "trainer.save_interval=1", *ONE_SLOT, "data.train_batch_size=8", "rollout.n=2",
                         "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-3",
                         "algorithm.estimator=gae", "algorithm.kl_in_reward_coef=0.01", "algorithm.kl_target=0.5",
                         "algorithm.kl_horizon=64", "ref.placement=separate",
                         "actor.offload=true", "critic.offload=true", "ref.offload=true",
                         "critic.optim.lr=1e-4", "critic.micro_batch_tokens=4096", f"reward.model={rm}",
                         "data.val_path=", "trainer.loggers=[jsonl]"], ray_address), out)
    steps = _metrics(out)
    for metrics in steps.values():
        assert {"critic/value_loss", "critic/grad_norm", "actor/kl_ref", "reward/model_mean"} <= metrics.keys()
        assert metrics["critic/grad_norm"] > 0 and metrics["actor/grad_norm"] > 0
    assert abs(steps[1]["actor/kl_ref"]) < 1e-6 and abs(steps[2]["actor/kl_ref"]) > 1e-6
    # the adaptive KL coefficient: at step 1 KL 0 -> the largest step down, x (1 - 0.2 x 16 / 64); saved with the
    # checkpoint for a resumed run
    assert steps[1]["algorithm/kl_coef"] == 0.01 and abs(steps[1]["algorithm/kl_in_reward"]) < 1e-6
    assert abs(steps[2]["algorithm/kl_coef"] - 0.01 * 0.95) < 1e-12
    saved = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["kl_coef"]
    kl2 = steps[2]["algorithm/kl_in_reward"]
    assert abs(saved - 0.0095 * (1 + min(max(kl2 / 0.5 - 1, -0.2), 0.2) * 16 / 64)) < 1e-12
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("timing/offload_s" in r and "timing/reload_s" in r for r in records) == 2
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_000001", "step_000001_critic", "step_000002", "step_000002_critic"]


def test_sft_only_job(tmp_path):
    """sft.only: the SFT stage alone (no prompts, no engine); its model is an HF checkpoint transformers loads, and
    the logged loss fell."""
    import transformers as T

    out = tmp_path / "sft"
    result = subprocess.run(
        [sys.executable, "tools/launch.py", "recipes/quickstart.yaml", f"trainer.output_dir={out}", "sft.only=true",
         "sft.steps=30", "data.train_path=", "data.val_path=", "trainer.loggers=[jsonl]"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [json.loads(line)["sft/sft_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5])
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["sft-rank0.log", "sft-rank1.log"]  # no engine
    model = T.AutoModelForCausalLM.from_pretrained(out / "init_hf")
    tokenizer = T.AutoTokenizer.from_pretrained(out / "init_hf")
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2


def _server_args(log: Path) -> tuple[str, int]:
    """(host, port) an SGLang server said it listens on."""
    host, port = re.search(r"Uvicorn running on http://([^:\s]+):(\d+)", log.read_text(errors="replace")).groups()
    return host, int(port)


@pytest.mark.slow
def test_two_colocated_engines_at_dp2_then_two_attached(ray_address, tmp_path):
    """Two devices with an engine each (colocated; a port each from rollout.engine.base_port; on 127.0.0.1) and the
    actor at DP=2 (each rank given only its data-parallel share): both engines hold the actor's weights after every
    sync (each engine's log-probs of its own samples equal the actor's; prompts are dealt to both). Then a run
    attached to two servers started here (rollout.engine.addresses; weights by broadcast) does the same."""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout import cpu
    from rlhf_mc.rollout.base import SamplingParams
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    base = next(p for p in iter(free_port, None) if _port_free(p + 1))
    out = tmp_path / "two"
    shared_memory = set(Path("/dev/shm").glob("torch_*"))
    common = ["trainer.total_steps=2", "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=8",
              "data.val_path=", "trainer.loggers=[jsonl]", "actor.optim.lr=1e-3",
              "reward.function=tests.test_trainer:char_codes"]
    _finish(_start(out, ["recipes/quickstart.yaml", "sft.data_path=", "resources.devices_per_node=2",
                         "rollout.engine.num_engines=2", f"rollout.engine.base_port={base}", *common], ray_address),
            out)
    # the weight sync's shared-memory staging went with the run (Ray's kill of the workers leaves what they made)
    assert set(Path("/dev/shm").glob("torch_*")) <= shared_memory
    placement = json.loads((out / "placement.json").read_text())
    assert [row["roles"] for row in placement] == [["actor rank 0", "rollout engine 0 tp rank 0"],
                                                  ["actor rank 1", "rollout engine 1 tp rank 0"]]
    logs = sorted((out / "logs").rglob("sglang_engine*.log"))
    assert sorted(_server_args(log) for log in logs) == [("127.0.0.1", base), ("127.0.0.1", base + 1)]
    # On CPU each engine decodes on its own device slot's cores, as SGLang reports them.
    cores = sorted(re.search(r"local_omp_cpuid=(\S+)", log.read_text(errors="replace")).group(1) for log in logs)
    assert cores == [cpu.thread_binding(range(e, e + 1), 2) for e in range(2)]

    def check(run: Path) -> None:
        steps = _metrics(run)
        assert sorted(steps) == [1, 2]
        for record in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()):
            if "reward/mean" in record:
                assert record["rollout/logprob_diff"] < 1e-4 and record["sync/failed_engines"] == 0, record
                assert record["actor/grad_norm"] > 0

    check(out)
    # a context of 16 tokens: 14 a sequence (SGLang keeps 2), the recipe's 8 + 6
    engines = SGLangEngine(RolloutConfig(model_path=str(out / "init_hf"), num_engines=2, dtype="float32",
                                         context_length=16), log_dir=tmp_path / "attached_logs")
    try:
        attached = tmp_path / "attached"
        addresses = ",".join(url.removeprefix("http://") for url in engines.urls)
        args = ["recipes/quickstart.yaml", f"model.path={out / 'final_hf'}", "sft.data_path=",
                f"rollout.engine.addresses=[{addresses}]", "rollout.engine.num_engines=2",
                # the servers above were launched so; attached, the recipe's launch flags are refused
                "rollout.engine.dtype=auto", "rollout.engine.extra_args=[]", *common]
        too_long = _start(tmp_path / "too_long", [*args, "data.max_response_length=7"], ray_address)
        assert too_long.wait(timeout=300) == 2
        assert (f"error: rollout.engine.addresses: the server at {engines.urls[0].removeprefix('http://')} holds 14 "
                "tokens a sequence, fewer than data.max_prompt_length + data.max_response_length = 15"
                in (tmp_path / "too_long.log").read_text())
        _finish(_start(attached, args, ray_address), attached)
        check(attached)
        for url in engines.urls:  # each server holds the run's last weights
            (sample,) = SGLangEngine(RolloutConfig(addresses=(url.removeprefix("http://"),))).generate(
                [[3, 4, 5]], SamplingParams(temperature=0, max_new_tokens=2))
            assert set(sample.versions) == {2}
    finally:
        engines.shutdown()


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


@pytest.mark.slow
def test_dapo_dynamic_sampling_drops_tied_groups_and_refills_the_batch(ray_address, tmp_path):
    """DAPO's dynamic sampling: groups whose two samples score alike are dropped and more prompts are rolled out
    until the step has data.train_batch_size prompts (16 samples) whose groups differ. (Running out of rounds, and
    a group filter from its import path: tests/test_rollouts.py.)"""
    common = ["recipes/quickstart.yaml", "sft.data_path=", "trainer.total_steps=2", "data.train_batch_size=8",
              "rollout.n=2", "actor.ppo_mini_batch_size=8", "data.val_path=", "trainer.loggers=[jsonl]", *ONE_SLOT]
    out = tmp_path / "dapo"
    _finish(_start(out, [*common, "reward.function=tests.test_trainer:char_code_parity",
                         "algorithm.dynamic_sampling_max_rounds=8"], ray_address), out)
    steps = _metrics(out)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        # every kept group of two differs: one sample of each scores 1
        assert record["data/samples"] == 16 and record["reward/accuracy"] == 0.5
    assert sum(r["data/groups_dropped"] for r in steps.values()) > 0
    assert max(r["data/rollout_rounds"] for r in steps.values()) > 1


@pytest.mark.slow
def test_moe_recipe_trains_with_expert_parallelism_and_routing_replay(ray_address, tmp_path):
    """recipes/grpo_moe_cpu.yaml for two steps: a Qwen3-MoE actor at EP=2 (two Megatron ranks, two experts each),
    its load-balancing loss logged, SGLang serving the model and returning the experts it routed each token to,
    which the actor's forward passes replay (two mini-batches: the old log-probs too); after each sync the engine's
    log-probs of its own samples equal the actor's (with the routing misaligned by a token they would not), and the
    final export is an HF Qwen3-MoE checkpoint that transformers loads whole."""
    import transformers as T

    out = tmp_path / "moe"
    _finish(_start(out, ["recipes/grpo_moe_cpu.yaml", "sft.data_path=", "trainer.total_steps=2",
                         "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.val_path=",
                         "actor.router.replay=true", "trainer.loggers=[jsonl]"], ray_address), out)
    steps = _metrics(out)
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        assert metrics["actor/grad_norm"] > 0 and metrics["sync/failed_engines"] == 0
        assert 0.5 < metrics["actor/router/load_balancing_loss"] < 2  # 1 when the experts share tokens evenly
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records if "rollout/logprob_diff" in r)
    model, info = T.AutoModelForCausalLM.from_pretrained(out / "final_hf", output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and not any(info.values()), info


@pytest.mark.slow
def test_tool_recipe_trains_on_multi_turn_trajectories(ray_address, tmp_path):
    """recipes/tool_calculator.yaml for two steps after a short SFT on its tool-calling conversations: the rollouts
    call the calculator in the sandbox and go on after its result, and the trainer's log-probs of the sampled tokens
    of these multi-turn trajectories equal the engine's (the inserted tokens are the ones the engine saw)."""
    out = tmp_path / "tool"
    _finish(_start(out, ["recipes/tool_calculator.yaml", "sft.steps=100", "trainer.total_steps=2",
                         "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "data.val_size=16",
                         "trainer.loggers=[jsonl]", "reward.function=tests.test_trainer:char_codes"], ray_address), out)
    steps = _metrics(out)
    assert sorted(steps) == [1, 2]
    assert sum(m["rollout/tool_calls"] for m in steps.values()) > 0
    for metrics in steps.values():
        assert metrics["actor/grad_norm"] > 0
        assert metrics["rollout/turns"] == 1 + metrics["rollout/tool_calls"] - metrics["rollout/truncated"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val/tool_calls" in r] == [0, 2]
    diffs = [r["rollout/logprob_diff"] for r in records if "rollout/logprob_diff" in r]
    assert len(diffs) == 2 and max(diffs) < 1e-4, diffs


@pytest.mark.slow
def test_one_step_off_overlaps_the_next_rollout_with_training(ray_address, tmp_path):
    """rollout.mode=one_step_off on two processes (the actor on one, the engine on the other): from the second step
    on, each batch was generated by the weights one version before the ones it trains (every sampled token is
    checked by the rollout manager; the run fails on an older one). How much of the rollout the overlap hides is a
    timing, measured by bench/async_modes.py, not asserted here."""
    out = tmp_path / "off"
    _finish(_start(out, ["recipes/quickstart.yaml", "sft.data_path=", "trainer.total_steps=4",
                         "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8", "data.val_path=",
                         "trainer.loggers=[jsonl]",
                         "rollout.mode=one_step_off", "rollout.engine.num_engines=1", "rollout.placement=disaggregated",
                         "resources.devices_per_node=2", "reward.function=tests.test_trainer:char_codes"],
                   ray_address), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "reward/mean" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[k]["rollout/staleness_max"] for k in range(1, 5)] == [0, 1, 1, 1]
    assert all(steps[k]["rollout/staleness_mean"] == 1 for k in (2, 3, 4))
    for k in (2, 3, 4):
        assert "timing/old_logprob_s" in steps[k] and steps[k]["actor/grad_norm"] > 0


@pytest.mark.slow
def test_async_mode_trains_within_the_staleness_bound(ray_address, tmp_path):
    """rollout.mode=async, max_staleness=1, on two processes: groups of the next step generate while the actor
    trains (every sampled token's version is checked against the bound by the rollout manager, which fails the run
    on an older one); the logged histogram of the trained tokens' staleness stays within the bound, and from the
    second step on part of each batch comes from the version before the trained one."""
    out = tmp_path / "async"
    _finish(_start(out, ["recipes/quickstart.yaml", "sft.data_path=", "trainer.total_steps=4",
                         "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8", "data.val_path=",
                         "trainer.loggers=[jsonl]",
                         "rollout.mode=async", "rollout.engine.num_engines=1", "rollout.max_staleness=1",
                         "rollout.placement=disaggregated", "resources.devices_per_node=2",
                         "reward.function=tests.test_trainer:char_codes"], ray_address), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "reward/mean" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[1]["rollout/staleness_max"] == 0  # the first batch: admitted and trained at version 0
    for k in range(1, 5):
        assert steps[k]["rollout/staleness_max"] <= 1
        assert steps[k]["rollout/staleness_0"] + steps[k]["rollout/staleness_1"] == pytest.approx(1)
        assert steps[k]["actor/grad_norm"] > 0 and "timing/old_logprob_s" in steps[k]
    assert steps[2]["rollout/staleness_1"] > 0, steps[2]  # generated during the first step's training
