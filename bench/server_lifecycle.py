"""A CPU SGLang server's fixed costs, paid by every run and engine restart: seconds from launch to serving, and to a
stopped process tree. Our stop (SIGTERM, SIGKILL to what is left after 1 s) against SGLang's own shutdown (SIGTERM,
then waiting for the tree to exit by itself: the same call with a 30 s grace), in turn over --rounds servers each.
Prints JSON lines: the medians and the ratio.

    .venv/bin/python bench/server_lifecycle.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from bench.rollout_throughput import write_model  # noqa: E402
from rlhf_mc.config import RolloutConfig  # noqa: E402
from rlhf_mc.rollout.sglang_server import ServerProcess  # noqa: E402
from rlhf_mc.runtime.spawn import free_port  # noqa: E402


def lifecycle(model_dir: Path, log_dir: Path, grace_s: float) -> tuple[float, float]:
    """(seconds to serving, seconds to stopped) of one server on one of two device slots, as the quickstart's."""
    server = ServerProcess(0, RolloutConfig(model_path=str(model_dir), dtype="float32"), free_port(), log_dir,
                           memory_saver=False, slots=range(0, 1), slots_on_host=2)
    start = time.perf_counter()
    server.start()
    server.wait_ready(300)
    ready = time.perf_counter() - start
    start = time.perf_counter()
    server.stop(grace_s=grace_s)
    return ready, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, "1m")
        runs: dict[str, list[tuple[float, float]]] = {"ours": [], "sglang": []}
        for _ in range(args.rounds):
            for name, grace_s in (("ours", 1.0), ("sglang", 30.0)):
                runs[name].append(lifecycle(model_dir, Path(tmp), grace_s))
    ready = statistics.median(r for pairs in runs.values() for r, _ in pairs)
    emit(figure="CPU SGLang server, launch to serving", value=round(ready, 2), unit="s",
         all=[round(r, 2) for pairs in runs.values() for r, _ in pairs])
    ours, theirs = (statistics.median(s for _, s in runs[name]) for name in ("ours", "sglang"))
    emit(figure="CPU SGLang server stop", value=round(ours, 2), unit="s", rounds=[round(s, 2) for _, s in runs["ours"]],
         baseline="SIGTERM and wait (SGLang's own shutdown)", baseline_s=round(theirs, 2),
         baseline_rounds=[round(s, 2) for _, s in runs["sglang"]], ratio_baseline_over_ours=round(theirs / ours, 2))


if __name__ == "__main__":
    main()
