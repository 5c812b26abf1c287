"""How a rank on a machine without a GPU uses the host: its share of the cores, glibc's allocator told to keep
freed memory, and MKL's AVX-512 kernels on AMD CPUs.

glibc returns a freed block of 32 MB or more (an 8k-token micro-batch's MLP activations or logits) and the top of the
heap over 128 KB to the kernel at once, so the next micro-batch faults every page in again. Measured with getrusage
on bench/ref_logprob.py's workload (300 sequences, 8192-token micro-batches): 2.9-3.8M minor faults and 8-10 s of
system time with glibc's defaults, 0.6-0.7M and 2-2.6 s with a 32 MB mmap threshold (user time unchanged). 32 MB is
the largest threshold glibc takes: a block of that size or more is still mmap'ed and faulted in at every use (an
8192 x 2048 bf16 MLP activation took 29 ms to produce against 23 ms at 8191 rows). Mmap'ing no block at all
(M_MMAP_MAX 0) took bench/ref_logprob.py's pass from 8.16 to 7.7 s, but blocks of gigabytes then fragment the heap:
bench/logprob_memory.py (one 8192-token sequence, a 152k vocabulary) peaked at 8.3-9.3 GB and took 9.4-13.2 s,
against 4.3 GB and 6.2 s with the threshold. Large vocabularies are the common case, so blocks of 32 MB or more
stay mmap'ed.

torch's CPU matmuls are MKL's, and MKL picks its kernels by the CPU's vendor: on an AMD CPU it takes its generic code
branch (`mkl_serv_cpu_detect()` 0) whatever the CPU has. On this project's 2-core AMD EPYC (AVX-512) a 1024^3 fp32
product runs at 174 GFLOP/s there and at 390 GFLOP/s on MKL's AVX-512 branch (7), which a process gets when its
vendor test, one exported function, answers "Intel" (the known workaround since MKL 2020.1 dropped
MKL_DEBUG_CPU_TYPE): the process is started with a one-line library preloaded, built here with the C compiler.
Same fp32 arithmetic, other kernels. Processes we start (spawned ranks, Ray workers, SGLang servers) get it through
`exec_env`; a process cannot give it to itself once started.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping

import torch

log = logging.getLogger(__name__)

# mallopt parameter -> value; the environment variable of the same setting for processes we exec (SGLang servers)
MALLOC = {
    -1: ("MALLOC_TRIM_THRESHOLD_", 256 << 20),  # M_TRIM_THRESHOLD: keep up to 256 MB free at the heap top
    -2: ("MALLOC_TOP_PAD_", 64 << 20),  # M_TOP_PAD: grow the heap 64 MB at a time
    -3: ("MALLOC_MMAP_THRESHOLD_", 32 << 20),  # M_MMAP_THRESHOLD: glibc's largest; blocks below it reuse the heap
}


def cores_per(ranks_on_host: int) -> int:
    """An equal share of this machine's cores: N processes each with every core's worth of threads thrash."""
    return max(1, (os.cpu_count() or 1) // ranks_on_host)


def use_host(ranks_on_host: int) -> None:
    """Called first in every CPU rank: its share of the cores (Ray sets OMP_NUM_THREADS=1) and the allocator
    settings above."""
    torch.set_num_threads(cores_per(ranks_on_host))
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):  # glibc only
        for param, (_, value) in MALLOC.items():
            libc.mallopt(param, value)


MKL_VENDOR_SHIM = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo, "" where unreadable."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def amd_cpu() -> bool:
    return "AuthenticAMD" in _cpuinfo()


def build_library(name: str, source: str, language: str, flags: list[str], without: str) -> str | None:
    """`source` (`language` "c" or "c++") compiled with `flags` into a shared library, once per user and machine into
    ~/.cache/rlhf_mc (its name hashes the source, the flags and this CPU, for -march=native; built under a temp name,
    then renamed: processes starting at once may build it together). None where no compiler ($CC / $CXX, else cc /
    c++) is found or it fails: logged with `without`, what the process then goes without."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlhf_mc"
    key = hashlib.sha1("\0".join([source, *flags, _cpu_identity()]).encode()).hexdigest()[:8]
    lib = cache / f"{name}_{key}.so"
    if lib.exists():
        return str(lib)
    compiler = shutil.which(os.environ.get("CC", "cc") if language == "c" else os.environ.get("CXX", "c++"))
    if compiler is None:
        log.warning("no %s compiler to build %s: %s", language, name, without)
        return None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, built = Path(tmp) / f"{name}.{'c' if language == 'c' else 'cpp'}", Path(tmp) / f"{name}.so"
            src.write_text(source)
            subprocess.run([compiler, "-shared", "-fPIC", "-o", str(built), str(src), *flags], check=True,
                           capture_output=True, text=True)
            built.replace(lib)
    except (OSError, subprocess.CalledProcessError) as e:  # a speed-up not had is no reason to stop a run
        log.warning("could not build %s (%s): %s", lib, getattr(e, "stderr", None) or e, without)
        return None
    return str(lib)


def _cpu_identity() -> str:
    """This CPU's model and instruction sets (/proc/cpuinfo's first processor)."""
    lines = _cpuinfo().splitlines()
    return "\n".join(next((line for line in lines if line.startswith(field)), "") for field in ("model name", "flags"))


@functools.cache
def mkl_preload() -> str | None:
    """The library that gives MKL's AVX-512 kernels to an AMD CPU (see the module's doc); None where it does not
    apply (not AMD, torch without MKL) or cannot be built (logged: matmuls at MKL's generic speed)."""
    if not amd_cpu() or not torch.backends.mkl.is_available():
        return None
    return build_library("mkl_vendor_shim", MKL_VENDOR_SHIM, "c", ["-O2"],
                         "MKL keeps its generic kernels on this AMD CPU (about half the matmul speed)")


def exec_env(inherited: Mapping[str, str]) -> dict[str, str]:
    """For a CPU process started with exec from an environment `inherited`: the allocator settings above and, on an
    AMD CPU, MKL's AVX-512 kernels (LD_PRELOAD, after whatever `inherited` preloads)."""
    env = {name: str(value) for name, value in MALLOC.values()}
    lib = mkl_preload()
    preloads = inherited.get("LD_PRELOAD", "").split()
    if lib and lib not in preloads:
        env["LD_PRELOAD"] = " ".join([*preloads, lib])
    return env


def children_as_cpu_ranks(**extra: str):
    """Processes started inside (they inherit the environment at start) get exec_env and `extra`; the caller's
    environment is restored after."""
    return environ(**{**exec_env(os.environ), **extra})


@contextlib.contextmanager
def environ(**changes: str):
    """This process's environment with `changes` inside the block (what libraries read at a call, and processes
    started there), restored after."""
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
