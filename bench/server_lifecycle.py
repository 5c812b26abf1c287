"""A CPU SGLang server's fixed costs, paid by every run and engine restart: seconds from launch to serving, and to a
stopped process tree. Our stop (ServerProcess.stop) against what SGLang's own tests call
(sglang.srt.utils.kill_process_tree: SIGKILL to the tree, then reaping it) and against SGLang's graceful shutdown
(SIGTERM, then waiting up to 30 s for the tree to exit by itself), in turn over --rounds servers each. Also the
seconds it takes to import kill_process_tree in a fresh process (what calling it would add to a process that has no
other use for sglang.srt.utils). Prints JSON lines: the medians and the ratios.

    .venv/bin/python bench/server_lifecycle.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from sglang.srt.utils import kill_process_tree  # imported before anything is timed (its import: import_seconds)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from bench.rollout_throughput import write_model  # noqa: E402
from rlhf_mc.config import RolloutConfig  # noqa: E402
from rlhf_mc.rollout.sglang_server import ServerProcess  # noqa: E402
from rlhf_mc.runtime.spawn import free_port  # noqa: E402


def sglang_kill(server: ServerProcess) -> None:
    kill_process_tree(server.proc.pid)
    server.proc.wait()


def graceful(server: ServerProcess) -> None:
    tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    for proc in tree:
        proc.send_signal(signal.SIGTERM)
    psutil.wait_procs(tree, timeout=30)
    server.stop()  # whatever outlived the grace


STOPS = {"ours": ServerProcess.stop, "kill_process_tree": sglang_kill, "graceful": graceful}


def lifecycle(model_dir: Path, log_dir: Path, stop) -> tuple[float, float]:
    """(seconds to serving, seconds to stopped) of one server on one of two device slots, as the quickstart's."""
    server = ServerProcess(0, RolloutConfig(model_path=str(model_dir), dtype="float32"), free_port(), log_dir,
                           memory_saver=False, slots=range(0, 1), slots_on_host=2)
    start = time.perf_counter()
    server.start()
    server.wait_ready(300)
    ready = time.perf_counter() - start
    start = time.perf_counter()
    stop(server)
    return ready, time.perf_counter() - start


def import_seconds() -> float:
    code = "import time; t = time.perf_counter(); from sglang.srt.utils import kill_process_tree; " \
           "print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, "1m")
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in STOPS}
        for _ in range(args.rounds):
            for name, stop in STOPS.items():
                runs[name].append(lifecycle(model_dir, Path(tmp), stop))
    ready = statistics.median(r for pairs in runs.values() for r, _ in pairs)
    emit(figure="CPU SGLang server, launch to serving", value=round(ready, 2), unit="s",
         all=[round(r, 2) for pairs in runs.values() for r, _ in pairs])
    stops = {name: statistics.median(s for _, s in pairs) for name, pairs in runs.items()}
    for name, label in (("kill_process_tree", "sglang.srt.utils.kill_process_tree (SGLang's tests)"),
                        ("graceful", "SIGTERM and wait (SGLang's own shutdown)")):
        emit(figure="CPU SGLang server stop", value=round(stops["ours"], 2), unit="s",
             rounds=[round(s, 2) for _, s in runs["ours"]], baseline=label, baseline_s=round(stops[name], 2),
             baseline_rounds=[round(s, 2) for _, s in runs[name]],
             ratio_baseline_over_ours=round(stops[name] / stops["ours"], 2))
    emit(figure="import of sglang.srt.utils.kill_process_tree in a fresh process", value=round(import_seconds(), 2),
         unit="s")


if __name__ == "__main__":
    main()
