"""Peak memory of the log-prob pass over one long sequence with a large vocabulary (Qwen3's 151936), where the logits
dominate: a 2-layer bf16 model (hidden 64) so that nothing else counts. Ours (compute_log_prob: the model's bf16
logits, upcast and softmaxed a chunk of tokens at a time, ops/logprobs.py) against what a transformers user writes
(`log_softmax(model(x).logits.float()).gather(...)`), each in its own process; the figure is the process's peak RSS
during the pass over its RSS before it (CPU), next to the bytes of the sequence's full fp32 logits. Prints JSON
lines. (The GPU side, Qwen3-0.6B at 32k tokens, is bench/gpu_figures.py's logprob_memory.)

    .venv/bin/python bench/logprob_memory.py [--tokens 8192]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, in_child, transformers_model  # noqa: E402
from rlhf_mc.config import ModelConfig, ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn  # noqa: E402

MODEL = ModelConfig(family="qwen3", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                    ffn_hidden_size=128, vocab_size=151936, max_position_embeddings=65536, qk_norm=True,
                    tie_embeddings=True)


def _measured(pass_over, tokens: int) -> tuple[float, float]:
    """(peak RSS growth in bytes, seconds) of pass_over(tokens), after a short pass that allocates the rest."""
    g = torch.Generator().manual_seed(0)
    pass_over(torch.randint(0, MODEL.vocab_size, (64,), generator=g))
    sequence = torch.randint(0, MODEL.vocab_size, (tokens,), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    pass_over(sequence)
    seconds = time.perf_counter() - start
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024.0, seconds


def ours(tokens: int) -> tuple[float, float]:
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob

    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(MODEL, ParallelConfig(), dtype="bfloat16")
    return _measured(lambda seq: compute_log_prob(chunks, Trajectories.single_turn([seq], [1]),
                                                  micro_batch_tokens=tokens), tokens)


def transformers_log_softmax(tokens: int) -> tuple[float, float]:
    model = transformers_model(MODEL).eval()

    def pass_over(seq):
        with torch.no_grad():
            logits = model(seq[None]).logits[0, :-1].float()
            return torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0]

    return _measured(pass_over, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    full = args.tokens * MODEL.vocab_size * 4
    ((ours_bytes, ours_s),) = spawn(ours, 1, args.tokens)
    theirs_bytes, theirs_s = in_child(transformers_log_softmax, args.tokens)
    emit(bench="logprob_memory", figure="peak extra memory of one sequence's log-prob pass", tokens=args.tokens,
         vocab=MODEL.vocab_size, value_gb=round(ours_bytes / 2**30, 2),
         baseline="transformers: log_softmax of the fp32 logits", baseline_gb=round(theirs_bytes / 2**30, 2),
         ratio=round(ours_bytes / theirs_bytes, 2), full_fp32_logits_gb=round(full / 2**30, 2),
         over_full_fp32_logits=round(ours_bytes / full, 2), seconds=round(ours_s, 2), baseline_s=round(theirs_s, 2))


if __name__ == "__main__":
    main()
