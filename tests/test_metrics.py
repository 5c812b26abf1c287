"""Metrics: the JSONL record and TensorBoard events a run writes, and tools/plot_metrics.py's reading of them (a
resumed run's repeated steps keep their last value; SFT lines stay out of the RL curves)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlhf_mc.trainer.metrics import MetricsLogger, Timer

REPO = Path(__file__).resolve().parents[1]


def test_logger_and_plot(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    from plot_metrics import load, plot

    logger = MetricsLogger(tmp_path, ("jsonl", "tensorboard"), total_steps=3, first_step=0, config={},
                           project="p", experiment="e")
    timer = Timer()
    with timer("rollout"):
        pass
    logger.log(0, {"sft/sft_loss": 2.0})
    logger.log(1, {"reward/mean": 0.1, **timer.times})
    logger.log(2, {"reward/mean": 0.2, "val/accuracy": 0.5})
    logger.log(2, {"reward/mean": 0.25})  # step 2 again, as after a resume
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 2] and lines[1]["timing/rollout_s"] >= 0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    series = load(tmp_path / "metrics.jsonl")
    assert series["reward/mean"] == ([1, 2], [0.1, 0.25]) and series["val/accuracy"] == ([2], [0.5])
    assert "sft/sft_loss" not in series
    drawn = plot(series, tmp_path / "curves.png", "t")
    assert {"reward/mean", "val/accuracy", "timing/rollout_s"} <= set(drawn)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
