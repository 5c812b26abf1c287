"""What a run prints: the framework warnings that every CPU-only or TE-less process would repeat, filtered where the
processes start (the workers, spawned ranks, the launcher), as the tests' pytest configuration does; and a launch's
log, split between its file (everything) and the console (ours, and errors)."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

# (message regex, category): each says something true that a user cannot act on here
_WARNINGS = [
    (r".*(Transformer Engine|Apex).*not installed", UserWarning),  # the local spec and torch optimizers are chosen
    (r".*CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
    (r"full scope is deprecated", UserWarning),  # megatron-core 0.19's default cuda_graph_scope, not ours
]


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_framework_warnings() -> None:
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    # megatron-core 0.19 logs it once per model built: we build GPTModel on purpose (HybridModel is not released)
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DropMessage("GPTModel IS DEPRECATED"))


FILE_ONLY = {"file_only": True}  # `extra` of a record for the launch's log file alone (phases, tracebacks)


class _Console(logging.Filter):
    """On the console: rlhf_mc's own messages from INFO up, the frameworks' errors; the rest goes to the file."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False):
            return False
        return record.name.startswith("rlhf_mc") or record.levelno >= logging.ERROR


def log_run(log_file: Path) -> None:
    """A launch's logging: everything (Python warnings and Ray's driver messages included) into `log_file`, with
    timestamps; a short line on the console (stderr) for rlhf_mc's own messages and for errors."""
    import tqdm

    log_file.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_file)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    class ToConsole(logging.Handler):  # through tqdm, so that a message does not cut a progress bar in two
        def emit(self, record: logging.LogRecord) -> None:
            tqdm.tqdm.write(self.format(record), file=sys.stderr)

    to_console = ToConsole()
    to_console.addFilter(_Console())
    to_console.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.handlers = [to_file, to_console]
    logging.captureWarnings(True)
    quiet_framework_warnings()
    import ray  # noqa: F401 - its logger configured now, before ray.init prints through it

    ray_logger = logging.getLogger("ray")
    ray_logger.handlers, ray_logger.propagate = [], True


def output_to(log_file: str | Path) -> None:
    """This process's stdout and stderr (the file descriptors: native libraries' output too) appended to `log_file`:
    a Ray worker's output in the run's folder, not interleaved on the launcher's console."""
    import os

    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
