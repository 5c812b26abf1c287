"""Metrics: the JSONL record and TensorBoard events a run writes, and tools/plot_metrics.py's reading of them (a
resumed run's repeated steps keep their last value; SFT lines stay out of the RL curves); wandb (offline) and MLflow
(a local file store) runs read back, a relaunch of the run dir continuing the same run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _launches(run_dir: Path, loggers: tuple[str, ...], configs: list[dict]) -> None:
    """Two launches of one run dir, each with its config: steps 1 and 2, then (the relaunch) step 3."""
    for config, steps in zip(configs, ([1, 2], [3])):
        logger = MetricsLogger(run_dir, loggers, total_steps=3, first_step=steps[0] - 1, config=config, project="p",
                               experiment="e")
        for step in steps:
            logger.log(step, {"reward/mean": step / 10, "val/pass@4": step / 4})
        logger.close()


def _wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """{step: metrics} of an offline run's .wandb log, read by wandb's own reader: `wandb leet inspect` prints the
    log's records as protobuf text when its output is not a terminal (wandb 0.30 has no Python reader)."""
    from google.protobuf import text_format
    from wandb.proto.wandb_internal_pb2 import Record

    text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(run_file)], capture_output=True,
                          text=True, check=True).stdout
    history = {}
    for record_text in re.split(r"^# record \d+: \w+\n", text, flags=re.M)[1:]:
        record = text_format.Parse(record_text, Record())
        if record.HasField("history"):
            items = {"/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def test_wandb_offline_run_resumed(tmp_path, monkeypatch):
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                        "WANDB_DISABLE_GIT": "true", "WANDB_DIR": tmp_path, "WANDB_CONFIG_DIR": tmp_path / "config",
                        "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(name, str(value))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _launches(run_dir, ("wandb",), [{"actor": {"lr": 1e-5}}] * 2)
    run_id = (run_dir / "wandb_run_id").read_text()
    # Offline, each launch writes its own log, both under the one run id: `wandb sync` uploads them in turn.
    logs = sorted((run_dir / "wandb").glob("offline-run-*/*.wandb"), key=lambda path: path.stat().st_mtime)
    assert [path.name for path in logs] == [f"run-{run_id}.wandb"] * 2
    assert _wandb_history(logs[0]) == {1: {"reward/mean": 0.1, "val/pass@4": 0.25},
                                       2: {"reward/mean": 0.2, "val/pass@4": 0.5}}
    assert _wandb_history(logs[1]) == {3: {"reward/mean": 0.3, "val/pass@4": 0.75}}


def test_mlflow_file_store_run_resumed(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # registered, so that the logger's opt-in is undone after
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # More params than one request takes (100), a value over mlflow's limit, and a relaunch that changes a value.
    config = {"actor": {"lr": 1e-5}, "many": {f"k{i}": i for i in range(150)}, "long": "x" * (MAX_PARAM_VAL_LENGTH + 1)}
    _launches(run_dir, ("mlflow",), [config, {**config, "actor": {"lr": 2e-5}, "new": True}])
    client = MlflowClient(f"file:{run_dir.resolve() / 'mlruns'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED" and run.info.run_name == "e"
    assert client.get_experiment(run.info.experiment_id).name == "p"
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
               for key in ("reward/mean", "val/pass_at_4")}
    assert history == {"reward/mean": [(1, 0.1), (2, 0.2), (3, 0.3)], "val/pass_at_4": [(1, 0.25), (2, 0.5), (3, 0.75)]}
    params = run.data.params
    assert len(params) == 153 and params["many.k149"] == "149" and params["long"] == "x" * MAX_PARAM_VAL_LENGTH
    assert params["actor.lr"] == "1e-05" and params["new"] == "True"  # the first launch's value; the new key added


def test_mlflow_tracking_uri_from_env(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'server'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _launches(tmp_path, ("mlflow",), [{}, {}])
    run_id = (tmp_path / "mlflow_run_id").read_text()
    assert not (tmp_path / "mlruns").exists()
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "reward/mean")] == [1, 2, 3]


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_missing_package_is_an_error(tmp_path, monkeypatch, package):
    for name in [name for name in sys.modules if name.split(".")[0] == package] + [package]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError):
        MetricsLogger(tmp_path, (package,), total_steps=1, first_step=0, config={}, project="p", experiment="")
