"""GPU-only tests: skipped without CUDA. The rest of the suite hides the GPUs (tests/conftest.py) and runs on the
CPU; these run with `RLHF_MC_GPU_TESTS=1 pytest tests/gpu` on a GPU machine (tools/gpu_check.sh does), some of them
only where SGLang or Transformer Engine is installed (the Docker image), each saying why it skips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU test: needs CUDA (RLHF_MC_GPU_TESTS=1 pytest tests/gpu on a GPU machine)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
