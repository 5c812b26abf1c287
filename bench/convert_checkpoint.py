"""Checkpoint conversion time and peak memory for a ~125M-parameter Llama-style model, next to its weight bytes.

Baselines, same invocation: a plain safetensors copy of the same weights (load every file, save it again), and an
idle worker job of the same layout (imports and process groups, no weights).
Prints JSON lines: {"bench", "phase", "seconds", "peak_process_mb", "peak_total_mb", "weights_mb", ratios}.

    .venv/bin/python bench/convert_checkpoint.py [--tp 2 --pp 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, peak_memory  # noqa: E402
from rlhf_mc.bridge.convert import hf_to_mcore, mcore_to_hf  # noqa: E402
from rlhf_mc.config import ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn  # noqa: E402


def write_model(out: Path) -> int:
    import transformers as T

    config = T.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                           num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=2048)
    model = T.LlamaForCausalLM(config)
    model.save_pretrained(out, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def plain_copy(src: Path, dst: Path) -> None:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in sorted(src.glob("*.safetensors")):
        save_file(load_file(f), str(dst / f.name), metadata={"format": "pt"})


def idle_worker(layout: ParallelConfig) -> None:
    """What a worker costs before it holds any weights: imports, process groups."""
    from rlhf_mc.runtime import init_parallel

    init_parallel(layout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = write_model(tmp / "hf")
        weights_mb = sum(f.stat().st_size for f in (tmp / "hf").glob("*.safetensors")) / 2**20
        with peak_memory() as base:
            copy = multiprocessing.get_context("spawn").Process(target=plain_copy, args=(tmp / "hf", tmp / "copy"))
            copy.start()
            copy.join()
        emit(bench="convert_checkpoint", phase="baseline_plain_safetensors_copy", params=params,
             weights_mb=round(weights_mb, 1), **{k: round(v, 2) for k, v in base.items()})
        layout = ParallelConfig(tp=args.tp, pp=args.pp)
        with peak_memory() as idle:
            spawn(idle_worker, layout.model_parallel_size, layout)
        emit(bench="convert_checkpoint", phase=f"baseline_idle_worker_tp{args.tp}_pp{args.pp}",
             **{k: round(v, 2) for k, v in idle.items()})
        with peak_memory() as to_mcore:
            hf_to_mcore(tmp / "hf", tmp / "mcore", layout, progress=False)
        with peak_memory() as to_hf:
            mcore_to_hf(tmp / "mcore", tmp / "back", progress=False)
        for phase, m in ((f"hf_to_mcore_tp{args.tp}_pp{args.pp}", to_mcore), ("mcore_to_hf_tp1", to_hf)):
            emit(bench="convert_checkpoint", phase=phase, params=params, weights_mb=round(weights_mb, 1),
                 **{k: round(v, 2) for k, v in m.items()},
                 seconds_vs_plain_copy=round(m["seconds"] / base["seconds"], 2),
                 peak_process_mb_vs_weights=round(m["peak_process_mb"] / weights_mb, 2),
                 peak_process_mb_above_idle_vs_weights=round(
                     (m["peak_process_mb"] - idle["peak_process_mb"]) / weights_mb, 2))


if __name__ == "__main__":
    main()
