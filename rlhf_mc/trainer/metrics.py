"""Metrics of every step: a progress bar with the key numbers, a JSONL file (the record tools/plot_metrics.py
draws from), TensorBoard, and wandb when installed and asked for."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from tqdm import tqdm

KEY_NUMBERS = ("reward/mean", "val/accuracy", "actor/kl_ref", "actor/entropy", "response/length_mean",
               "timing/step_s")


class Timer:
    """`with timer("rollout"):` adds timing/rollout_s."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}_s"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start


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

            self.wandb = wandb.init(project=project, name=experiment or run_dir.name, config=config,
                                    dir=str(run_dir), resume="allow")
        self.bar = tqdm(total=total_steps, initial=first_step, desc="steps", dynamic_ncols=True,
                        disable="console" not in loggers)
        self.last: dict[str, float] = {}

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
        self.last.update(metrics)
        self.bar.set_postfix({k.split("/", 1)[1]: f"{self.last[k]:.3g}" for k in KEY_NUMBERS if k in self.last},
                             refresh=False)

    def advance(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
