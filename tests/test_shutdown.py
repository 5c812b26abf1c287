"""Clean shutdown of a run (tools/launch.py): Ctrl-C (SIGINT to the launcher's process group, as a terminal sends
it) during a rollout, and SIGTERM (to the launcher alone, as `kill` or a scheduler sends it) during a weight sync.
The run finishes the step under way and its checkpoint (one is due every step here), exits with 128 + the signal,
and leaves nothing behind: no process it started, no weight-sync staging in /dev/shm, no port listening; the
checkpoint is complete, so a relaunch resumes from it.

The phase under way is read from the run's status.json (trainer/metrics.py). A rollout is held long enough to be
signalled in by SGLang's /slow_down (every forward batch sleeps); a sync by stopping (SIGSTOP) the engine's server
while the step's checkpoint is written, so that the sync that follows waits for it until the signal is sent."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import requests

from rlhf_mc.rollout.sglang_server import running
from rlhf_mc.trainer import checkpoints
from tests.test_trainer import _server_args, _start, _wait_for

pytestmark = pytest.mark.slow

ARGS = ["recipes/quickstart.yaml", "sft.data_path=", "trainer.total_steps=40", "trainer.save_interval=1",
        "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=8", "data.val_path=",
        "trainer.loggers=[jsonl]", "resources.devices_per_node=1", "rollout.engine.num_engines=1"]


def _status(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _listening(processes: list[psutil.Process]) -> set[int]:
    ports = set()
    for p in processes:
        with contextlib.suppress(psutil.Error):
            ports |= {c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    return ports


# Each signal once and each phase once (a launch each, ~40 s), not all four pairs: the launcher's handler is the same
# for both signals (it sets the stop flag the step loop reads at the step's end), whatever phase is under way.
@pytest.mark.parametrize("signum, phase", [(signal.SIGINT, "rollout"), (signal.SIGTERM, "sync")],
                         ids=["SIGINT-rollout", "SIGTERM-sync"])
def test_a_signal_finishes_the_step_and_leaves_nothing_behind(signum, phase, tmp_path):
    out = tmp_path / "run"
    staging_before = set(Path("/dev/shm").glob("torch_*"))
    proc = _start(out, ARGS)
    _wait_for(proc, out, (out / "checkpoints" / "step_000001" / "trainer_state.json").exists, "step 1",
              timeout_s=600)
    started = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    ports = _listening(started)
    _, port = _server_args(out / "logs" / "engine0" / "sglang_engine0.log")
    assert port in ports
    (server,) = [p for p in started if "sglang.launch_server" in " ".join(p.cmdline())]
    server_tree = [server, *server.children(recursive=True)]
    if phase == "rollout":
        requests.post(f"http://127.0.0.1:{port}/slow_down", json={"forward_sleep_time": 1.0}, timeout=30)
        _wait_for(proc, out, lambda: _status(out).get("phase") == "rollout", "a rollout")
        time.sleep(0.5)
    else:
        _wait_for(proc, out, lambda: _status(out).get("phase") == "save", "a checkpoint")
        for p in server_tree:
            p.suspend()
        _wait_for(proc, out, lambda: _status(out).get("phase") == "sync", "a sync")
        time.sleep(0.5)
    step = _status(out)["step"]
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    if phase == "sync":
        for p in server_tree:
            p.resume()
    assert proc.wait(timeout=180) == 128 + signum, out.with_suffix(".log").read_text()[-3000:]
    log = out.with_suffix(".log").read_text()
    assert f"{signal.Signals(signum).name}: stopping after this step" in log

    # the step under way (`step` steps were done) is logged and its checkpoint complete: the relaunch's start
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == step + 1, (step, logged)
    assert checkpoints.resume_from(out, "auto") == checkpoints.checkpoint_dir(out, step + 1)

    deadline = time.time() + 30
    while (left := [p for p in started if running(p)]) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}"
    assert set(Path("/dev/shm").glob("torch_*")) <= staging_before, "weight-sync staging left in /dev/shm"
    held = {c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert not ports & held, f"ports still listening: {sorted(ports & held)}"
