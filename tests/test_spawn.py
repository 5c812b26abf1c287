"""Where local multi-process jobs run (runtime/spawn.py): a GPU per rank when the machine has enough, else every rank
on the CPU with the GPUs hidden from it - so a TP x PP conversion or a multi-rank test runs on a 1-GPU machine."""

from __future__ import annotations

import os

import pytest
import torch

from rlhf_mc.runtime.spawn import spawn, spawn_device


def test_ranks_take_gpus_only_when_there_is_one_for_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (spawn_device(1), spawn_device(2), spawn_device(32)) == ("cuda", "cpu", "cpu")
    assert spawn_device(1, "cpu") == "cpu"
    with pytest.raises(ValueError, match="^32 ranks need 32 GPUs, this machine has 1$"):
        spawn_device(32, "cuda")


def _visible() -> tuple[str | None, bool]:
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def test_cpu_ranks_see_no_gpu():
    assert spawn(_visible, 2, device="cpu") == [("", False), ("", False)]
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""  # the suite's own setting (conftest.py), restored


def test_tools_refuse_cuda_without_a_gpu_per_rank(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "hf-to-mcore", "--hf", str(tmp_path),
                             "--out", str(tmp_path / "out"), "--tp", "2", "--device", "cuda"], cwd=repo,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == \
        "error: 2 ranks need 2 GPUs, this machine has 0"
