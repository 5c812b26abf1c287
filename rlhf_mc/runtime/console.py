"""What a run prints: the framework warnings that every CPU-only or TE-less process would repeat, filtered where the
processes start (the workers, spawned ranks, the launcher), as the tests' pytest configuration does."""

from __future__ import annotations

import logging
import warnings

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
