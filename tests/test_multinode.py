"""Multi-node rehearsal on one machine: two Ray nodes (a head and a second node, one CPU "device" each, on
loopback), and a tiny disaggregated recipe submitted with --address: the actor lands on one node and the SGLang engine
on the other, so placement and the weight broadcast cross a node boundary. After every sync the engine's log-probs of
its own samples equal the actor's (rollout/logprob_diff), and every sample carries the expected weight version (the
trainer checks it and would stop)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ray_cluster, ray_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_nodes(tmp_path):
    with ray_cluster(tmp_path, 2, 1) as address:
        yield address


@pytest.mark.slow
def test_disaggregated_run_across_two_nodes(two_nodes, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "tools/launch.py", "recipes/quickstart.yaml", "--address", two_nodes,
         f"trainer.output_dir={out}", "resources.nodes=2", "resources.devices_per_node=1",
         "rollout.placement=disaggregated", "rollout.engine.num_engines=1", "sft.data_path=", "trainer.total_steps=3",
         "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.optim.lr=1e-3", "data.val_size=8",
         "trainer.loggers=[jsonl]", "reward.function=tests.test_trainer:char_codes"],
        cwd=REPO, env=ray_env(), capture_output=True, text=True, timeout=900)
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
