"""One SGLang server as a supervised child process: start, wait until it serves, stop its whole process tree."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import psutil
import requests

from rlhf_mc.config import ConfigError, RolloutConfig
from rlhf_mc.rollout import cpu

LORA_NAME = "policy"  # the adapter a LoRA-serving engine generates with (RolloutConfig.lora_adapter)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that forked it ends (PR_SET_PDEATHSIG follows the thread,
    not the process). Children are forked by _SPAWNER, which lives as long as this process: so a server dies
    with its owner, even one killed by SIGKILL (a Ray actor killed with its job). SGLang's own subprocesses follow
    their parent."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# One daemon thread forks every child, so that a restart asked for from a short-lived request thread does not give the
# new server a parent-death signal that fires when that thread ends. A daemon: it outlives the atexit handlers that
# stop servers gracefully (an executor's thread would end first, SIGKILLing them).
_JOBS: queue.SimpleQueue = queue.SimpleQueue()
_SPAWNER: threading.Thread | None = None
_SPAWNER_LOCK = threading.Lock()


def _fork_forever() -> None:
    while True:
        future, cmd, popen_kwargs = _JOBS.get()
        try:
            future.set_result(subprocess.Popen(cmd, **popen_kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            future.set_exception(error)


def start_child(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, ...) in its own session, killed when this process dies."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None or not _SPAWNER.is_alive():  # not alive: in a forked child
            _SPAWNER = threading.Thread(target=_fork_forever, name="rlhf_mc-spawner", daemon=True)
            _SPAWNER.start()
    future: Future = Future()
    _JOBS.put((future, cmd, {**popen_kwargs, "start_new_session": True, "preexec_fn": _die_with_parent}))
    return future.result()


def running(proc: psutil.Process) -> bool:
    """Whether `proc` still runs (a zombie has exited: only its exit status is left)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ServerProcess:
    def __init__(self, index: int, cfg: RolloutConfig, port: int, log_dir: Path, memory_saver: bool, slots: range,
                 slots_on_host: int):
        """`memory_saver`: SGLang's --enable-memory-saver, which makes release_memory_occupation free GPU memory
        (torch_memory_saver, CUDA only; on CPU a release frees nothing and the flag is left out). The server's TP
        ranks sit on device `slots` of the `slots_on_host` on this machine: on CPU each slot a share of its cores,
        on GPU the visible GPUs of those indices."""
        self.index, self.cfg, self.port, self.memory_saver = index, cfg, port, memory_saver
        self.slots, self.slots_on_host = slots, slots_on_host
        self.url = f"http://{cfg.host}:{port}"
        self.log_path = log_dir / f"sglang_engine{index}.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cfg = self.cfg
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
               "--port", str(self.port), "--tp-size", str(cfg.tp), "--dtype", cfg.dtype,
               # We send and receive token ids only: no tokenizer in the server, no retokenization.
               "--skip-tokenizer-init",
               # An idle scheduler otherwise polls its sockets in a busy loop: a whole core per engine while the
               # trainer computes (measured: two idle CPU servers took 2.0 cores). It wakes on the next message.
               "--sleep-on-idle"]
        if cfg.context_length is not None:
            cmd += ["--context-length", str(cfg.context_length)]
        if cfg.chunked_prefill_size is not None:
            cmd += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
        if cfg.deterministic:
            cmd += ["--enable-deterministic-inference"]
        if cfg.return_routed_experts:
            cmd += ["--enable-return-routed-experts"]
        if cfg.random_weights:
            cmd += ["--load-format", "dummy"]
        if cfg.lora_adapter:
            adapter = json.loads((Path(cfg.lora_adapter) / "adapter_config.json").read_text())
            # one adapter, replaced at every sync: one slot in the batch
            cmd += ["--enable-lora", "--max-lora-rank", str(adapter["r"]), "--lora-target-modules",
                    *adapter["target_modules"], "--lora-paths", f"{LORA_NAME}={cfg.lora_adapter}",
                    "--max-loras-per-batch", "1"]
            if cpu.on_cpu():  # the other backends are triton kernels (GPU)
                cmd += ["--lora-backend", "torch_native"]
        if cpu.on_cpu():
            cmd += cpu.server_args(cfg.max_total_tokens, cfg.mem_fraction_static)
        else:
            # its TP ranks on the visible GPUs `slots`: without it every engine of a machine takes GPUs 0..tp-1
            cmd += ["--base-gpu-id", str(self.slots.start)]
            if cfg.max_total_tokens is not None:
                cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
            if cfg.mem_fraction_static is not None:
                cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
            if self.memory_saver:
                cmd += ["--enable-memory-saver"]
        return cmd + list(cfg.extra_args)

    def _check_port_free(self) -> None:
        """Another server on the port would answer our health checks and requests as if it were ours."""
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: closed connections are no use
            try:
                s.bind((self.cfg.host, self.port))
            except OSError as error:
                field = "rollout.engine.base_port" if self.cfg.base_port else "rollout.engine"
                raise ConfigError(f"{field}: port {self.port} on {self.cfg.host} (engine {self.index}) is in use "
                                  f"({error.strerror}); choose another base_port, or 0 for free ports") from None

    def _tree(self) -> list[psutil.Process]:
        """The server's process and its children (scheduler, detokenizer); empty once it is gone."""
        try:
            return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _listening_here(self) -> bool:
        """Whether the process answering on the port is this server's (the HTTP server or one of its children)."""
        for proc in self._tree():
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in proc.net_connections()):
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    def start(self) -> None:
        self._check_port_free()
        env = cpu.server_env(dict(os.environ), self.slots, self.slots_on_host) if cpu.on_cpu() else dict(os.environ)
        # SGLang's HTTP server drops a connection idle for 5 s; our client keeps its connections between rollouts
        # (training, checkpoints and validation take longer), and a request sent on a dropped one fails with
        # "Connection reset by peer" and is retried through a health check: measured 26 retries and 16 s of a 3 s
        # rollout after a checkpoint. Keep idle connections as long as a request may take.
        env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", str(int(self.cfg.request_timeout_s)))
        # Only the model classes we serve are imported at start-up (rollout/sglang_models); a user's package wins.
        env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "rlhf_mc.rollout.sglang_models")
        with open(self.log_path, "ab") as log:
            # Own session: the server and its scheduler processes form one process group we can signal whole.
            self.proc = start_child(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"SGLang engine {self.index} exited with code {self.proc.returncode} during "
                                   f"start-up; log tail ({self.log_path}):\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health_generate", timeout=10).status_code == 200:
                    if not self._listening_here():
                        self.stop()
                        raise RuntimeError(f"SGLang engine {self.index}: the server answering on port {self.port} "
                                           "is not the one started here")
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SGLang engine {self.index} did not serve within {timeout_s:.0f} s; log tail "
                           f"({self.log_path}):\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGKILL to the server's processes, then to anything else left in its session, and reaps the server: what
        sglang.srt.utils.kill_process_tree does (SGLang's own tests stop servers with it), without importing that
        module (5 s in a fresh process, bench/server_lifecycle.py; the callers have no other use for it). A SIGTERM
        first gains nothing: the scheduler and detokenizer exit at once, but the HTTP server's process takes that
        for a crash and sleeps 5 s "before crash diagnostics" (signalled alone, it acts at its watchdog's next
        5-second tick), and the same /dev/shm files are left either way."""
        if self.proc is None:
            return
        tree = self._tree()
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything else left in its session
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        # Its port and memory are free once every process of the tree has exited; a zombie has (its parent, killed
        # too, leaves it to init to reap, which waiting for would add a second).
        deadline = time.monotonic() + 10
        while any(running(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_bytes()[-20000:].decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
