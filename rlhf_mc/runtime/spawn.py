"""Runs a function on N local processes joined in one torch.distributed job (tests, tools, single-machine runs).

Each process gets torchrun's environment, joins the default group (NCCL with one GPU per rank, gloo on CPU), runs
`fn(*args)`, and hands its return value back. A failing rank's traceback is raised in the caller; the other ranks are
killed, so nothing lingers.

Where: `device="auto"` takes one GPU per rank when the machine has enough, else runs every rank on the CPU (gloo; the
GPUs hidden from the ranks): a TP=8 x PP=4 conversion runs on a machine with one GPU, or none.

Kept ranks (RLHF_MC_KEEP_RANKS=1, as tests/conftest.py sets it): the processes of a job stay after it and run the next
job of the same shape (world size, device, skipped shims), each job in a new default group and Megatron state. A
process start plus the imports of torch and Megatron-Core take ~9 s on a 2-core machine (a job of a tiny model takes
well under one), so a caller that runs many small jobs saves most of its time. A failed or timed-out job ends its
ranks; at most two shapes are kept (memory), the least recently used given up first.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import socket
import time
import tempfile
import traceback
from collections import OrderedDict
from multiprocessing.connection import Connection, wait
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


def _set_up_rank(world_size: int) -> None:
    console.quiet_framework_warnings()
    if torch.cuda.is_available():
        torch.set_num_threads(host.cores_per(world_size))
    else:
        host.use_host(world_size)


def _run_job(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple,
             skip_cpu_shims: tuple[str, ...]) -> None:
    from rlhf_mc.runtime import distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        distributed.init_distributed(skip_cpu_shims=skip_cpu_shims)
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        distributed.destroy()


def _entry(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple,
           skip_cpu_shims: tuple[str, ...]) -> None:
    _set_up_rank(world_size)
    _run_job(fn, rank, world_size, port, out_dir, args, skip_cpu_shims)


def _kept_entry(conn: Connection, rank: int, world_size: int, skip_cpu_shims: tuple[str, ...]) -> None:
    """A kept rank: runs the jobs it is sent (fn, port, out_dir, args) until None or its caller's end (the pipe
    closes); exits after a failed one."""
    _set_up_rank(world_size)
    while (job := _receive(conn)) is not None:
        fn, port, out_dir, args = job
        try:
            _run_job(fn, rank, world_size, port, out_dir, args, skip_cpu_shims)
        except BaseException:
            conn.send(False)
            raise
        conn.send(True)


def _receive(conn: Connection):
    try:
        return conn.recv()
    except EOFError:
        return None


class _KeptRanks:
    """The processes of one job shape, kept between jobs (see the module's doc)."""

    def __init__(self, world_size: int, on_cpu: bool, skip_cpu_shims: tuple[str, ...]):
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(world_size)]
        self.conns = [ours for ours, _ in pipes]
        # not daemons: Megatron's checkpoint saving starts processes of its own
        self.procs = [ctx.Process(target=_kept_entry, args=(theirs, rank, world_size, skip_cpu_shims))
                      for rank, (_, theirs) in enumerate(pipes)]
        with host.children_as_cpu_ranks(CUDA_VISIBLE_DEVICES="") if on_cpu else contextlib.nullcontext():
            for p in self.procs:
                p.start()
        for _, theirs in pipes:  # the ranks hold them now: a rank's death reads as the end of its pipe
            theirs.close()

    def run(self, fn: Callable, args: tuple, out_dir: str, timeout_s: float) -> None:
        port = free_port()
        for conn in self.conns:
            conn.send((fn, port, out_dir, args))
        deadline, waiting = time.monotonic() + timeout_s, dict(zip(self.conns, range(len(self.conns))))
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"distributed job did not finish within {timeout_s:.0f} s")
            for conn in ready:
                rank = waiting.pop(conn)
                if not _receive(conn):  # False, or the end of the pipe: the rank died without a word
                    # the others fail too, from the first one's broken connections: report the first to fail
                    wait(list(waiting), timeout=1.0)
                    errors = sorted(Path(out_dir).glob("rank*.err"), key=lambda e: e.stat().st_mtime)
                    first = int(errors[0].stem.removeprefix("rank")) if errors else rank
                    _raise_failure(first, len(self.procs), out_dir, self.procs[first].exitcode)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_kept: OrderedDict[tuple, _KeptRanks] = OrderedDict()


@atexit.register
def _close_kept() -> None:
    while _kept:
        _kept.popitem()[1].close()


def _kept_ranks(world_size: int, on_cpu: bool, skip_cpu_shims: tuple[str, ...]) -> _KeptRanks:
    key = (world_size, on_cpu, tuple(sorted(skip_cpu_shims)))
    if key in _kept:
        _kept.move_to_end(key)
    else:
        while len(_kept) >= 2:
            _kept.popitem(last=False)[1].close()
        _kept[key] = _KeptRanks(world_size, on_cpu, skip_cpu_shims)
    return _kept[key]


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
    on_cpu = spawn_device(world_size, device) == "cpu"
    with tempfile.TemporaryDirectory(prefix="rlhf_mc_spawn_") as out_dir:
        if os.environ.get("RLHF_MC_KEEP_RANKS") == "1":
            ranks = _kept_ranks(world_size, on_cpu, skip_cpu_shims)
            try:
                ranks.run(fn, args, out_dir, timeout_s)
            except BaseException:
                _kept.pop(next(k for k, v in _kept.items() if v is ranks), None)
                for p in ranks.procs:
                    p.kill()
                raise
            return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, out_dir, args, skip_cpu_shims))
                 for rank in range(world_size)]
        # CPU ranks see no GPU, and get MKL's fastest kernels on an AMD CPU (host.exec_env)
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
        _raise_failure(failed[0], len(procs), out_dir, procs[failed[0]].exitcode)


def _raise_failure(rank: int, world_size: int, out_dir: str, exitcode: int | None) -> None:
    err = Path(out_dir) / f"rank{rank}.err"
    detail = err.read_text() if err.exists() else f"exit code {exitcode}"
    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{detail}")
