"""Weight sync seconds and bytes/s from a TP=2 (--tp) actor into an SGLang engine (colocated tensor transport) for a
~125M-parameter Llama-style model, vs a plain in-process copy of the same bytes (the baseline, same process), and
rank 0's peak extra memory vs the largest bucket (a tensor larger than the bucket size is a bucket of its own).
Two transports, one's syncs after the other's, as a run makes them (the engine keeps a transport's staging mapped
from one sync to the next): what "tensor" is on one CPU host (SharedStaging: every rank writes its shards into one
shared staging) and the per-device one it replaced there (ColocatedTensors: gathered over TP, HF layout, staging
copy; GPU's). Medians of --repeats, the copy's of 5. Prints JSON lines.

    .venv/bin/python bench/weight_sync.py [--buckets-mb 16 64 256] [--repeats 3] [--tp 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from bench.convert_checkpoint import write_model  # noqa: E402
from rlhf_mc.config import ParallelConfig, RolloutConfig  # noqa: E402
from rlhf_mc.rollout.sglang_engine import SGLangEngine  # noqa: E402
from rlhf_mc.runtime.spawn import spawn  # noqa: E402


def actor(model_dir: str, address: str, buckets_mb: list[int], repeats: int, tp: int) -> list[dict] | None:
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.sync.transports import ColocatedTensors, connect
    from rlhf_mc.sync.weights import WeightSync

    parallel = ParallelConfig(tp=tp)
    init_parallel(parallel)
    model = model_config_from_hf(read_hf_config(model_dir))
    chunks = build_model(model, parallel, init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    rank0 = torch.distributed.get_rank() == 0
    transports = {"shared": connect("tensor", [address], engine_ranks=[[0]]),
                  "gathered": ColocatedTensors([address], engine_ranks=[[0]])}
    rows, version = [], 0
    for mb in buckets_mb:
        syncs = {name: WeightSync(chunks, model, transport, bucket_bytes=mb * 2**20)
                 for name, transport in transports.items()}
        runs = {name: [] for name in syncs}
        for name, sync in syncs.items():  # one transport's syncs in a row, as a run makes them
            for _ in range(repeats):
                version += 1
                runs[name].append(sync.sync(chunks, version))
        if rank0:
            # Baseline: copy the same bytes within this process.
            plan = syncs["shared"].plan
            sources = [torch.randn(e.shape).to(e.dtype) for e in plan.entries]
            targets = [torch.empty_like(s) for s in sources]
            for s, t in zip(sources, targets):  # first touch of the targets' pages, not timed
                t.copy_(s)
            copies = []
            for _ in range(5):
                start = time.perf_counter()
                for s, t in zip(sources, targets):
                    t.copy_(s)
                copies.append(time.perf_counter() - start)
            copy_s = statistics.median(copies)
            for name, done in runs.items():
                rows.append({"transport": name, "bucket_mb": mb,
                             "largest_bucket_mb": plan.largest_bucket_bytes / 2**20, "bytes": done[0].bytes,
                             "buckets": done[0].buckets, "tensors": done[0].tensors,
                             "seconds": statistics.median(r.seconds for r in done), "copy_seconds": copy_s,
                             "peak_extra_mb": max(r.peak_extra_mb for r in done)})
    return rows if rank0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2, help="the actor's TP (gathers each tensor over gloo)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "hf"
        params = write_model(model_dir)
        engine = SGLangEngine(RolloutConfig(model_path=str(model_dir), dtype="float32"))
        try:
            rows = spawn(actor, args.tp, str(model_dir), engine.urls[0].removeprefix("http://"), args.buckets_mb,
                         args.repeats, args.tp)[0]
        finally:
            engine.shutdown()
    gathered = {row["bucket_mb"]: row["seconds"] for row in rows if row["transport"] == "gathered"}
    for row in rows:
        emit(bench="weight_sync", transport=row["transport"], actor=f"tp{args.tp}", engine="tp1", params=params,
             bucket_mb=row["bucket_mb"], mb=round(row["bytes"] / 2**20, 1), buckets=row["buckets"],
             seconds=round(row["seconds"], 3), mb_per_s=round(row["bytes"] / 2**20 / row["seconds"], 1),
             baseline_copy_seconds=round(row["copy_seconds"], 4),
             baseline_copy_mb_per_s=round(row["bytes"] / 2**20 / row["copy_seconds"], 1),
             vs_copy=round(row["copy_seconds"] / row["seconds"], 4),
             vs_gathered=round(gathered[row["bucket_mb"]] / row["seconds"], 2),
             peak_extra_mb=round(row["peak_extra_mb"], 1),
             largest_bucket_mb=round(row["largest_bucket_mb"], 1),
             peak_extra_vs_largest_bucket=round(row["peak_extra_mb"] / row["largest_bucket_mb"], 2))


if __name__ == "__main__":
    main()
