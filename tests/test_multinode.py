"""Multi-node rehearsal on one machine: two Ray nodes (a head and a second node, one CPU "device" each, on
loopback), and a tiny disaggregated recipe submitted with --address: the actor lands on one node and the SGLang engine
on the other, so placement and the weight broadcast cross a node boundary. After every sync the engine's log-probs of
its own samples equal the actor's (rollout/logprob_diff), and every sample carries the expected weight version (the
trainer checks it and would stop)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_mc.runtime.spawn import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
# Ray 2.60 turns on token authentication by default; the rehearsal's nodes talk over loopback only.
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       # a head node told to stop drains for 30 s by default (Ray 2.60), waiting for work nobody left running
       "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def _node(args: list[str], log: Path) -> subprocess.Popen:
    # --block: the `ray start` process supervises the node's processes and takes them down when it is killed.
    return subprocess.Popen([RAY, "start", "--block", "--num-cpus", "1", *args], env=ENV, start_new_session=True,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _alive_nodes(address: str) -> int:
    try:
        out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}', logging_level='ERROR');"
                              " print(sum(n['Alive'] for n in ray.nodes()))"], env=ENV, capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        return 0
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


@pytest.fixture
def two_nodes(tmp_path):
    import shutil
    import tempfile

    port = free_port()
    address = f"127.0.0.1:{port}"
    ray_tmp = tempfile.mkdtemp(prefix="rr", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    nodes = [_node(["--head", "--port", str(port), "--node-ip-address", "127.0.0.1", "--include-dashboard", "false",
                    "--temp-dir", ray_tmp], tmp_path / "head.log")]
    deadline = time.time() + 120
    for count, log in ((1, "head.log"), (2, "second.log")):
        if count == 2:
            nodes.append(_node(["--address", address, "--node-ip-address", "127.0.0.1"], tmp_path / log))
        while _alive_nodes(address) < count:
            assert time.time() < deadline and all(n.poll() is None for n in nodes), \
                (tmp_path / log).read_text()[-2000:]
            time.sleep(1)
    yield address
    for node in reversed(nodes):
        os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_disaggregated_run_across_two_nodes(two_nodes, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "tools/launch.py", "recipes/quickstart.yaml", "--address", two_nodes,
         f"trainer.output_dir={out}", "resources.nodes=2", "resources.devices_per_node=1",
         "rollout.placement=disaggregated", "rollout.engine.num_engines=1", "sft.data_path=", "trainer.total_steps=3",
         "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.optim.lr=1e-3", "data.val_size=8",
         "trainer.loggers=[jsonl]", "reward.function=tests.test_trainer:char_codes"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    placement = json.loads((out / "placement.json").read_text())
    assert [row["roles"] for row in placement] == [["actor rank 0"], ["rollout engine 0 tp rank 0"]]
    assert placement[0]["ray_node"] != placement[1]["ray_node"], placement
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["sync/bytes"] > 0 and r["actor/grad_norm"] > 0
        assert r["rollout/logprob_diff"] < 1e-4, r  # the engine holds the actor's weights after each broadcast
