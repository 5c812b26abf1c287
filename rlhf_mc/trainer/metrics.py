"""Metrics of every step: a progress bar with the key numbers, a JSONL file (the record tools/plot_metrics.py
draws from), TensorBoard, and wandb or MLflow when asked for."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from rlhf_mc.runtime.console import FILE_ONLY

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger("rlhf_mc.trainer")

KEY_NUMBERS = ("reward/mean", "val/accuracy", "actor/kl_ref", "actor/entropy", "response/length_mean",
               "timing/step_s")


class Timer:
    """`with timer("rollout"):` adds timing/rollout_s; `on_phase(name)` is told of each phase as it starts."""

    def __init__(self, on_phase: Callable[[str], None] | None = None):
        self.times: dict[str, float] = {}
        self.on_phase = on_phase

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.on_phase:
            self.on_phase(phase)
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}_s"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start


# MLflow accepts metric and param names of alphanumerics, "_", "-", ".", "/", ":" and spaces that are normalized
# paths (mlflow.utils.validation): of ours only pass@k's "@" falls outside, spelled "pass_at_k" there; any other
# character outside becomes "_" rather than stopping a run.
_MLFLOW_BAD_CHARS = re.compile(r"[^\w./\- :]")


def _mlflow_name(name: str) -> str:
    return _MLFLOW_BAD_CHARS.sub("_", name.replace("@", "_at_"))


def _flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """MLflow params are flat strings: {"actor": {"optim": {"lr": 1e-5}}} -> {"actor.optim.lr": "1e-05"}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _mlflow_run(run_dir: Path, config: dict, project: str, name: str) -> tuple[MlflowClient, str]:
    """The MLflow run this run dir logs to: made on the first launch and continued by a relaunch (its id kept in
    run_dir/mlflow_run_id, as wandb's in wandb_run_id)."""
    from mlflow.entities import Param  # the recipe asked for it: a missing package is an error
    from mlflow.tracking import MlflowClient

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = f"file:{run_dir.resolve() / 'mlruns'}"
        # MLflow 3.17 refuses its file store (in maintenance mode) unless opted in
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(uri)
    id_file = run_dir / "mlflow_run_id"
    if id_file.exists():
        run_id = id_file.read_text()
        client.update_run(run_id, status="RUNNING")
    else:
        experiment = client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(project)
        run_id = client.create_run(experiment_id, run_name=name).info.run_id
        id_file.write_text(run_id)
    # A param's value cannot change: a relaunch adds only the keys the run lacks. MLflow itself splits the list
    # into requests of at most 100 params and cuts values to 6000 characters (MLFLOW_TRUNCATE_LONG_VALUES).
    params = {_mlflow_name(key): value for key, value in _flatten(config).items()}
    logged = client.get_run(run_id).data.params
    client.log_batch(run_id, params=[Param(key, value) for key, value in params.items() if key not in logged])
    return client, run_id


class MetricsLogger:
    def __init__(self, run_dir: Path, loggers: tuple[str, ...], total_steps: int, first_step: int,
                 config: dict, project: str, experiment: str):
        self.loggers = loggers
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if "jsonl" in loggers else None
        self.tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = None
        if "wandb" in loggers:
            import wandb  # the recipe asked for it: a missing package is an error, not a silent skip

            # resume="allow" continues a run only given its id: the first launch's, kept in the run dir
            id_file = run_dir / "wandb_run_id"
            self.wandb = wandb.init(project=project, name=experiment or run_dir.name, config=config,
                                    dir=str(run_dir), id=id_file.read_text() if id_file.exists() else None,
                                    resume="allow")
            id_file.write_text(self.wandb.id)
        self.mlflow = None
        if "mlflow" in loggers:
            self.mlflow = _mlflow_run(run_dir, config, project, experiment or run_dir.name)
        self.bar = tqdm(total=total_steps, initial=first_step, desc="steps", dynamic_ncols=True,
                        disable="console" not in loggers)
        self.last: dict[str, float] = {}
        self.status_file, self.step, self.phase_name = run_dir / "status.json", first_step, ""
        self._status_lock = threading.Lock()  # phases start in the trainer's thread and the rollouts'

    def phase(self, name: str) -> None:
        """The phase under way (the latest started, rollout-thread phases included): shown on the progress bar and
        written to <run_dir>/status.json (steps done, phase, the launcher's pid), for whoever watches the run."""
        log.info("phase %s (step %d done)", name, self.step, extra=FILE_ONLY)
        with self._status_lock:
            self.phase_name = name
            self._postfix(refresh=True)
            tmp = self.status_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": self.step, "phase": name, "pid": os.getpid()}))
            tmp.replace(self.status_file)

    def _postfix(self, refresh: bool) -> None:
        numbers = {k.split("/", 1)[1]: f"{self.last[k]:.3g}" for k in KEY_NUMBERS if k in self.last}
        self.bar.set_postfix({**numbers, **({"phase": self.phase_name} if self.phase_name else {})}, refresh=refresh)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.mlflow:
            from mlflow.entities import Metric

            client, run_id = self.mlflow
            now_ms = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(_mlflow_name(k), v, now_ms, step) for k, v in metrics.items()])
        self.last.update(metrics)
        self._postfix(refresh=False)

    def advance(self) -> None:
        self.step += 1
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        if self.mlflow:
            client, run_id = self.mlflow
            client.set_terminated(run_id)
