"""Runs a function on N local processes joined in one torch.distributed job (tests, tools, single-machine runs).

Each process gets torchrun's environment, joins the default group (NCCL with one GPU per rank, gloo on CPU), runs
`fn(*args)`, and hands its return value back. A failing rank's traceback is raised in the caller; the other ranks are
killed, so nothing lingers.

Where: `device="auto"` takes one GPU per rank when the machine has enough, else runs every rank on the CPU (gloo; the
GPUs hidden from the ranks): a TP=8 x PP=4 conversion runs on a machine with one GPU, or none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import time
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.multiprocessing as mp

from rlhf_mc.runtime import console, host


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, for a server that binds it a little later. Not from the kernel's range for outgoing
    connections (any connection may take such a port as its local one before the server binds: seen in CI as
    EADDRINUSE), nor from Ray's worker ports (10002-19999): a random free one in between, else any free one."""
    low, high = 20000, _ephemeral_low() - 1
    pick = random.SystemRandom()  # not the seeded module RNG: processes seeded alike would all pick the same ports
    for _ in range(64 if high - low >= 1000 else 0):
        port = pick.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple,
           skip_cpu_shims: tuple[str, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    console.quiet_framework_warnings()
    if torch.cuda.is_available():
        torch.set_num_threads(host.cores_per(world_size))
    else:
        host.use_host(world_size)
    from rlhf_mc.runtime import distributed

    try:
        distributed.init_distributed(skip_cpu_shims=skip_cpu_shims)
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        distributed.destroy()


def spawn_device(world_size: int, device: Literal["auto", "cuda", "cpu"] = "auto") -> str:
    """Where `world_size` ranks run: "cuda" needs a GPU per rank."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and world_size > gpus:
        raise ValueError(f"{world_size} ranks need {world_size} GPUs, this machine has {gpus}")
    if device == "auto":
        device = "cuda" if 0 < world_size <= gpus else "cpu"
        if gpus and device == "cpu":
            logging.getLogger(__name__).warning("%d ranks > %d GPUs: running them on the CPU (gloo)", world_size,
                                                gpus)
    return device


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 900.0,
          skip_cpu_shims: tuple[str, ...] = (), device: Literal["auto", "cuda", "cpu"] = "auto") -> list[Any]:
    """Returns [fn's result on rank 0, ..., rank N-1]. `fn` must be importable (defined at module level)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rlhf_mc_spawn_") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, out_dir, args, skip_cpu_shims))
                 for rank in range(world_size)]
        on_cpu = spawn_device(world_size, device) == "cpu"
        # CPU ranks see no GPU, and get MKL's AVX-512 kernels on an AMD CPU (host.exec_env)
        with host.children_as_cpu_ranks(CUDA_VISIBLE_DEVICES="") if on_cpu else contextlib.nullcontext():
            for p in procs:
                p.start()
        try:
            _wait(procs, out_dir, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _wait(procs: list, out_dir: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs):
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"distributed job did not finish within {timeout_s:.0f} s")
        time.sleep(0.05)
    failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if failed:
        rank = failed[0]
        err = Path(out_dir) / f"rank{rank}.err"
        detail = err.read_text() if err.exists() else f"exit code {procs[rank].exitcode}"
        raise RuntimeError(f"rank {rank} of {len(procs)} failed:\n{detail}")
