"""Per-token log-probs of given token sequences under a checkpoint, at a given TP/PP.

    python tools/score.py --ckpt DIR --input seqs.jsonl --out scores.jsonl [--tp N --pp N --ep N]

DIR is an HF checkpoint directory or a distributed checkpoint from tools/convert_checkpoint.py. Each input line is a
JSON list of token ids (or {"tokens": [...]}); each output line is {"logprobs": [...]}, where entry i is
log p(token[i+1] | token[:i+1]) under the model (fp32 unless the checkpoint says otherwise), so len(tokens) - 1
values. Computed without gathering the vocabulary (Megatron's vocab-parallel cross entropy). --ep splits a
mixture-of-experts model's experts (EP beyond TP takes data-parallel ranks, as in training: tp*pp times
ep/gcd(ep, tp) ranks). The ranks take a GPU each where the machine has enough, else they run on the CPU (gloo);
--device forces one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.bridge.convert import checkpoint_model_config, load_weights  # noqa: E402
from rlhf_mc.config import ConfigError, ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn, spawn_device  # noqa: E402


def read_sequences(path: Path, vocab_size: int, max_len: int) -> list[list[int]]:
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}")
    sequences = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        tokens = item["tokens"] if isinstance(item, dict) else item
        where = f"{path}:{number}"
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{where}: expected a list of token ids, got {str(item)[:80]}")
        if not 2 <= len(tokens) <= max_len:
            raise ValueError(f"{where}: {len(tokens)} tokens; need 2 to max_position_embeddings={max_len}")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        sequences.append(tokens)
    if not sequences:
        raise ValueError(f"{path}: no sequences")
    return sequences


def score(ckpt: str, sequences: list[list[int]], parallel: ParallelConfig) -> list[list[float]] | None:
    from megatron.core import parallel_state as ps

    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.models.pipeline import run_pipeline
    from rlhf_mc.runtime import device, init_parallel

    model, dtype = checkpoint_model_config(ckpt)
    init_parallel(parallel)
    chunks = build_model(model, parallel, dtype=dtype, init_weights=False)
    load_weights(chunks, ckpt, model)
    for chunk in chunks:
        chunk.eval()
    microbatches = []
    for tokens in sequences:
        t = torch.tensor(tokens, device=device()).unsqueeze(0)
        microbatches.append({"tokens": t[:, :-1], "labels": t[:, 1:],
                             "position_ids": torch.arange(t.size(1) - 1, device=device()).unsqueeze(0)})
    with torch.no_grad():
        reports = run_pipeline(chunks, microbatches,
                               lambda mb, token_loss: (token_loss.sum() * 0, {"logprobs": -token_loss[0].float()}),
                               forward_only=True)
    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and
            ps.get_data_parallel_rank() == 0):
        return None
    return [r["logprobs"].cpu().tolist() for r in reports]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel (mixture-of-experts models)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: a GPU per rank when there are enough, else the CPU")
    args = parser.parse_args(argv)
    try:
        model, _ = checkpoint_model_config(args.ckpt)
        parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
        parallel.check_model(model)
        parallel.dp(parallel.min_world_size)  # EP must divide the ranks of a stage
        spawn_device(parallel.min_world_size, args.device)
        sequences = read_sequences(args.input, model.vocab_size, model.max_position_embeddings)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = [r for r in spawn(score, parallel.min_world_size, args.ckpt, sequences, parallel,
                                device=args.device) if r is not None]
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps({"logprobs": lp}) + "\n" for lp in results[0]))
    tmp.rename(args.out)
    print(f"wrote {len(results[0])} sequences to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
