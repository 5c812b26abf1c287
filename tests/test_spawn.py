"""Where local multi-process jobs run (runtime/spawn.py): a GPU per rank when the machine has enough, else every rank
on the CPU with the GPUs hidden from it - so a TP x PP conversion or a multi-rank test runs on a 1-GPU machine; and
CPU ranks (spawned or Ray workers) started with MKL's AVX-512 kernels on an AMD CPU (runtime/host.py)."""

from __future__ import annotations

import os

import pytest
import torch

from rlhf_mc.runtime import host
from rlhf_mc.runtime.spawn import spawn, spawn_device

# the library that gives MKL's AVX-512 kernels to an AMD CPU (runtime/host.py): only where it applies
mkl_vendor_shim = pytest.mark.skipif(host.mkl_preload() is None, reason="not an AMD CPU with MKL, or no C compiler")


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


def _best_mkl_branch() -> int:
    """The branch MKL takes on this CPU once told it is Intel's: 7 with AVX-512, 5 with AVX2 (seen on an AVX2-only
    EPYC VM of this workplace, 2026-12-06)."""
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    return 7 if "avx512f" in flags else 5


def _mkl_branch_and_error() -> tuple[int, float]:
    """MKL's code branch in this process (0: generic, 7: AVX-512) and a 512^3 fp32 product's largest error against
    float64, relative to its largest entry."""
    import ctypes

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    a, b = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)), torch.randn(512, 512)
    exact = a.double() @ b.double()
    return lib.mkl_serv_cpu_detect(), ((a @ b).double() - exact).abs().max().item() / exact.abs().max().item()


@mkl_vendor_shim
def test_cpu_ranks_get_mkl_avx512_kernels_on_amd():
    """MKL gives an AMD CPU its generic kernels (half the matmul speed on this project's EPYC); a CPU rank is
    started with the library that makes it take its best ones (AVX-512 or AVX2) (runtime/host.py), with fp32's accuracy; the
    caller's environment is left as it was."""
    before = dict(os.environ)
    plain = _mkl_branch_and_error()
    ((branch, error),) = spawn(_mkl_branch_and_error, 1, device="cpu")
    assert (plain[0], branch) == (0, _best_mkl_branch())
    assert error < 1e-5 and plain[1] < 1e-5
    assert dict(os.environ) == before


@mkl_vendor_shim
def test_local_ray_workers_get_mkl_avx512_kernels_on_amd(local_ray_rank):
    """The trainer's ranks are Ray workers: a local CPU instance starts them with the same library."""
    assert local_ray_rank["mkl"][0] == _best_mkl_branch() and local_ray_rank["mkl"][1] < 1e-5


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


# A driver process without megatron-core: a local Ray instance (trainer/placement.start_ray) and one rank of it
LOCAL_RAY_RANK = """
import json, sys, types
import ray, torch
from rlhf_mc.trainer.placement import start_ray
from tests.test_spawn import _mkl_branch_and_error

def tensors():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    return {"float32": x, "bfloat16": x.bfloat16(), "strided": x.t()[1:], "bool": x > 0, "int64": torch.arange(5),
            "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3), "grad": x.clone().requires_grad_()}

@ray.remote
def rank(sent):
    import megatron.core  # replaces torch's loader of pickled storages
    from rlhf_mc.runtime import ray_tensors
    ray_tensors.register()  # as every ModelWorker does
    sent["float32"].add_(1)  # what the driver sent arrives writable
    return _mkl_branch_and_error(), sent["float32"], tensors()

start_ray(None, types.SimpleNamespace(device="cpu", devices=1))
mkl, moved, got = ray.get(rank.remote(tensors()))
ray.shutdown()
want = tensors()
print(json.dumps({"mkl": mkl, "moved": torch.equal(moved, want["float32"] + 1),
                  "equal": {k: t.dtype == got[k].dtype and torch.equal(got[k], t.detach()) for k, t in want.items()},
                  "megatron_in_driver": "megatron" in sys.modules}))
"""


@pytest.fixture(scope="module")
def local_ray_rank() -> dict:
    """What a rank of a local Ray instance, started as the trainer starts it, reports and returns."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", LOCAL_RAY_RANK], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tensors_cross_ray_without_megatron_in_the_driver(local_ray_rank):
    """A rank (a Ray worker that imported megatron-core, which replaces torch's loader of pickled storages) gets the
    driver's tensors writable and returns tensors of several dtypes and layouts: the driver, a process without
    megatron-core, reads them equal without importing it (runtime/ray_tensors.py; it took 3.1 s of every run)."""
    assert local_ray_rank["moved"] and all(local_ray_rank["equal"].values()), local_ray_rank
    assert not local_ray_rank["megatron_in_driver"], "the driver imported megatron-core to read a rank's tensors"
