"""Causal attention over a pack of sequences on CPU without gradients, what a log-prob pass runs in every layer:
models/cpu_causal_attention.py's kernel (one call a pack) against SDPA on each sequence alone (what
models/attention.py ran there before: sequences of different lengths are one SDPA call each). bench/ref_logprob.py's
sequences (64-token prompts, 32-512-token responses) and attention shapes (8 heads over 4 KV groups of 32), in a
process started as rlhf_mc starts its ranks, --threads threads. Each dtype: ours and SDPA in turn for --rounds rounds,
each figure the best of 5 passes in its round; prints per dtype the medians over the rounds, their ratio (SDPA's time
over ours) and each one's largest error against SDPA in fp64, and the causal FLOP/s (4 x heads x head_dim x
L(L+1)/2 a sequence).

    .venv/bin/python bench/cpu_attention.py [--sequences 300 --dtypes float32 bfloat16 --threads 1 --rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, in_child  # noqa: E402
from bench.ref_logprob import MODEL, workload  # noqa: E402

HEADS, GROUPS, HEAD_DIM = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], MODEL["head_dim"]


def measure(n: int, dtype: str, threads: int) -> dict[str, tuple[float, float]]:
    """system -> (seconds, the best of 5 passes; largest error against fp64 SDPA)."""
    import torch.nn.functional as F

    from rlhf_mc.models import cpu_causal_attention

    torch.set_num_threads(threads)
    lengths = [len(s) for s in workload(n)]
    g = torch.Generator().manual_seed(0)
    # query, key and value as views of one projection's output, as Megatron gives them
    qkv = torch.randn(sum(lengths), HEADS + 2 * GROUPS, HEAD_DIM, generator=g).to(getattr(torch, dtype))
    q, k, v = qkv.split([HEADS, GROUPS, GROUPS], 1)
    scale = HEAD_DIM ** -0.5

    def sdpa(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                         is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
                          for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))])

    def ours(q, k, v):
        return cpu_causal_attention.packed_causal_attention(q, k, v, lengths, scale)

    assert cpu_causal_attention.applies(q), "the kernel could not be built here (see the log)"
    reference = sdpa(q.double(), k.double(), v.double())
    results = {}
    with torch.no_grad():
        for name, fn in (("rlhf_mc_packed_kernel", ours), ("sdpa_per_sequence", sdpa)):
            error = (fn(q, k, v).double() - reference).abs().max().item()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                fn(q, k, v)
                times.append(time.perf_counter() - start)
            results[name] = (min(times), error)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=300)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (a rank of the quickstart's: 1)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1 or args.threads < 1 or args.sequences < 1:
        parser.error("--rounds, --threads and --sequences take 1 or more")
    lengths = [len(s) for s in workload(args.sequences)]
    flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lengths)
    for dtype in args.dtypes:
        rounds = [in_child(measure, args.sequences, dtype, args.threads, as_rank=True) for _ in range(args.rounds)]
        seconds = {name: statistics.median(r[name][0] for r in rounds) for name in rounds[0]}
        ours, sdpa = seconds["rlhf_mc_packed_kernel"], seconds["sdpa_per_sequence"]
        emit(bench="cpu_attention", dtype=dtype, threads=args.threads, sequences=args.sequences,
             tokens=sum(lengths), ours_ms=round(ours * 1e3, 1), sdpa_ms=round(sdpa * 1e3, 1),
             speedup=round(sdpa / ours, 2), rounds=[round(r["sdpa_per_sequence"][0] / r["rlhf_mc_packed_kernel"][0], 2)
                                                    for r in rounds],
             ours_gflops_causal=round(flops / ours / 1e9, 1), sdpa_gflops_causal=round(flops / sdpa / 1e9, 1),
             ours_max_error=max(r["rlhf_mc_packed_kernel"][1] for r in rounds),
             sdpa_max_error=max(r["sdpa_per_sequence"][1] for r in rounds))


if __name__ == "__main__":
    main()
