"""The suite runs on Megatron-Core 0.19.2 (the Docker image's pin; tools/setup_env.sh installs it); 0.16.1, the newest
release that declares Python 3.11, must keep working: a fast parity check on it - a TP=2 x DP=2 model with the
distributed optimizer against the single-process one (logits, an Adam step; reference weights written and resharded
through Megatron's distributed checkpoints), Qwen3-MoE at EP=2 against one process, and the actor's train step at
TP=2 - run in a subprocess with the
0.16.1 copy (.venv/mcore-0.16.1) first on PYTHONPATH, its spawned ranks included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MCORE_016 = Path(sys.prefix) / "mcore-0.16.1"


def _with_mcore_016(*args: str, timeout: int) -> subprocess.CompletedProcess:
    assert (MCORE_016 / "megatron" / "core").is_dir(), f"{MCORE_016} is missing: run tools/setup_env.sh"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MCORE_016), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_suite_runs_megatron_core_0_19():
    import megatron.core

    assert megatron.core.__version__.startswith("0.19.2"), megatron.core.__version__


def test_parity_on_megatron_core_0_16():
    version = _with_mcore_016("-W", "ignore", "-c", "import megatron.core as m; print(m.__version__)", timeout=120)
    assert version.stdout.strip().splitlines()[-1].startswith("0.16.1"), version.stdout + version.stderr
    run = _with_mcore_016("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_parallel_parity.py",
                          "tests/test_train_step.py", "-k",
                          "tp2_dp2_distributed_optimizer or token-mean-tp2 or expert_parallel_matches_single_process"
                          "[tiny-qwen3-moe]",
                          timeout=900)
    # all three selected tests ran and passed (none skipped, none missing from the selection)
    assert run.returncode == 0 and re.search(r"^3 passed, \d+ deselected in ", run.stdout, re.M), (
        run.stdout[-3000:] + run.stderr[-3000:])
