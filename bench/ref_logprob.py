"""compute_ref_log_prob throughput and peak memory: ~700 sequences (64-token prompts, responses spread over
32-512 tokens) on a ~8M-parameter model, through rlhf_mc (host-memory reference swapped into the actor, packed,
micro-batched by tokens) vs (a) a per-sequence transformers loop, (b) one padded batched transformers forward and
(c) transformers on length-sorted padded batches of 8 (what a careful transformers user does), in a plain process,
and (d) the same in a process started as rlhf_mc starts its ranks (on an AMD CPU, MKL's AVX-512 kernels,
runtime/host.py: how much of the ratio to (c) is the kernels and how much the rest). Each runs in its own process,
measured for time and peak RSS; each after a warm-up pass over a few sequences (ours timed apart: on CPU the first
large forward compiles the element-wise kernels, once a process). Every side computes the logits of the positions
that predict response tokens only (ours: models/head.py; transformers: logits_to_keep, as TRL does), so none
pays for the prompts' vocabulary projection; the ratio to report is to (d), the same environment as ours. Ours and the length-sorted batches: the median of
--repeats passes in their process (single passes spread by ~20% run to run on a shared VM), the other two one pass;
with --rounds R ours and (c) and (d) run in turn R times, their ratios the medians of the rounds' (a process's figure
moves with the VM's drift: (c) read 9.8-12.3 s in single runs of one day).
Prints JSON lines with ratios, and each run's FLOP/s as a fraction of this machine's matmul FLOP/s in --dtype (the
forward's matmuls: 2 x matmul parameters per token, and causal attention,
2 x 2 x heads x head_dim x L(L+1)/2 per sequence and layer); `ratio_at_peak` is the length-sorted baseline's time
over those FLOPs at the peak: the most any system could beat it by on this machine.

    .venv/bin/python bench/ref_logprob.py [--sequences 700 --micro-batch-tokens 8192 --dtype float32 --repeats 3
                                          --dp 1 --rounds 1]
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

from bench.common import emit, in_child, llama_matmul_params, matmul_peak, peak_memory  # noqa: E402
from rlhf_mc.config import ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn  # noqa: E402

PROMPT = 64
WARMUP = 32  # sequences of our warm-up pass
OURS, SORTED = "rlhf_mc_ref_swap_packed", "transformers_length_sorted_batches_of_8"


def workload(n: int):
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(32, 513, (n,), generator=g).tolist()
    return [torch.randint(0, 1024, (PROMPT + r,), generator=g) for r in responses]


MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, vocab_size=1024, max_position_embeddings=1024)


def write_model(out: Path) -> None:
    import transformers as T

    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(**MODEL)).save_pretrained(out)


def forward_flops(seqs: list[torch.Tensor]) -> float:
    """The forward's matmul FLOPs over `seqs` (no padding, causal attention counted once per query-key pair)."""
    layers, heads, d = MODEL["num_hidden_layers"], MODEL["num_attention_heads"], MODEL["head_dim"]
    matmul_params = llama_matmul_params(MODEL["hidden_size"], layers, heads, MODEL["num_key_value_heads"], d,
                                        MODEL["intermediate_size"], MODEL["vocab_size"])
    tokens = sum(len(s) for s in seqs)
    pairs = sum(len(s) * (len(s) + 1) // 2 for s in seqs)
    return 2 * matmul_params * tokens + layers * 4 * heads * d * pairs


def ours(model_dir: str, n: int, micro_batch_tokens: int, dtype: str, repeats: int) -> tuple[list[float], float]:
    """Seconds of each of `repeats` passes over the workload, after a warm-up pass over its first WARMUP sequences
    (the seconds of that, the second value: on CPU it compiles the element-wise kernels, models/cpu_kernels.py, once
    a process as a training run does, where the reference's pass runs every step). Every rank of the spawned world
    takes its data-parallel share of the sequences, as the trainer deals them; a pass ends when the last rank's does."""
    import torch.distributed as dist

    from rlhf_mc.bridge.convert import checkpoint_model_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.data.microbatch import balance_across_ranks
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.policy import HostReference, compute_log_prob

    model, _ = checkpoint_model_config(model_dir)
    init_parallel(ParallelConfig())
    chunks = build_model(model, ParallelConfig(), dtype=dtype, init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    reference = HostReference(chunks)
    seqs = [s.tolist() for s in workload(n)]  # token lists, as a rollout returns them
    rank, world = dist.get_rank(), dist.get_world_size()
    times = []
    for part in [seqs[:WARMUP]] + [seqs] * repeats:
        share = [part[i] for i in balance_across_ranks([len(s) for s in part], world)[rank]]
        batch = Trajectories.single_turn(share, [PROMPT] * len(share))
        dist.barrier()
        start = time.perf_counter()
        with reference.swapped_in(chunks):
            compute_log_prob(chunks, batch, micro_batch_tokens=micro_batch_tokens)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[1:], times[0]


def hf_loop(model_dir: str, n: int, dtype: str) -> float:
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    seqs = workload(n)

    def one(s):  # the response's logits only (logits_to_keep: every position from the prompt's last)
        logits = model(s.unsqueeze(0), logits_to_keep=len(s) - PROMPT + 1).logits[0, :-1]
        torch.log_softmax(logits.float(), -1).gather(-1, s[PROMPT:, None])

    with torch.no_grad():
        for s in seqs[:WARMUP]:  # warm-up, as ours has
            one(s)
        start = time.perf_counter()
        for s in seqs:
            one(s)
    return time.perf_counter() - start


def padded_logprobs(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One right-padded transformers forward over `seqs`: each response's log-probs. The logits of the positions
    from the prompts' last on only (logits_to_keep, as TRL computes them; every prompt is PROMPT tokens), not of
    the prompts: the softmax still passes over the padding after the shorter responses, which a batch has."""
    tokens = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], mask[i, :len(s)] = s, 1
    logits = model(tokens, attention_mask=mask, logits_to_keep=tokens.size(1) - PROMPT + 1).logits
    logp = torch.log_softmax(logits.float(), -1)  # position j: PROMPT - 1 + j
    return [logp[i, :len(s) - PROMPT].gather(-1, s[PROMPT:, None]) for i, s in enumerate(seqs)]


def hf_padded(model_dir: str, n: int, dtype: str) -> float:
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    seqs = workload(n)
    with torch.no_grad():
        padded_logprobs(model, seqs[:WARMUP])  # warm-up, as ours has
        start = time.perf_counter()
        padded_logprobs(model, seqs)
    return time.perf_counter() - start


def hf_sorted_batches(model_dir: str, n: int, dtype: str, repeats: int, batch: int = 8) -> list[float]:
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    seqs = sorted(workload(n), key=len, reverse=True)
    with torch.no_grad():
        padded_logprobs(model, seqs[:batch])  # warm-up, as ours has
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            for first in range(0, n, batch):
                padded_logprobs(model, seqs[first:first + batch])
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=700)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="every system's weights")
    parser.add_argument("--repeats", type=int, default=3, help="passes of ours and of the sorted batches (median)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="ours and the sorted batches in turn this many times (ratios: the rounds' median)")
    parser.add_argument("--dp", type=int, default=1,
                        help="our data-parallel ranks, the cores split among them (the quickstart's layout: 2)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if args.dp < 1 or WARMUP % args.dp:
        parser.error(f"--dp: {args.dp} does not divide the {WARMUP} warm-up sequences")
    n = args.sequences - args.sequences % args.dp  # an equal count a rank
    seqs = workload(n)
    response_tokens = sum(len(s) - PROMPT for s in seqs)
    all_tokens = sum(len(s) for s in seqs)
    peak, flops = matmul_peak(args.dtype), forward_flops(seqs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        write_model(Path(model_dir))
        # ours and the length-sorted batches (plain and as a rank) in turn, each round minutes apart at most: on a
        # shared VM whose speed drifts by 10-30% from minute to minute, one process's figure moves with the drift
        rounds: list[dict[str, tuple[list[float], float]]] = []
        for _ in range(args.rounds):
            runs = {}
            with peak_memory() as m:
                (passes, warmup), *_ = spawn(ours, args.dp, model_dir, n, args.micro_batch_tokens, args.dtype,
                                             args.repeats)
            runs[OURS] = (passes, m["peak_process_mb"])
            emit(bench="ref_logprob", figure="ours: warm-up pass (compiles on CPU)", sequences=WARMUP,
                 value=round(warmup, 2), unit="s")
            for system, as_rank in ((SORTED, False), (SORTED + "_started_as_rlhf_mc_rank", True)):
                with peak_memory() as m:
                    passes = in_child(hf_sorted_batches, model_dir, n, args.dtype, args.repeats, as_rank=as_rank)
                runs[system] = (passes, m["peak_process_mb"])
            rounds.append(runs)
        once = {}  # the slow baselines, one pass each
        with peak_memory() as m:
            passes = [in_child(hf_loop, model_dir, n, args.dtype)]
        once["transformers_per_sequence_loop"] = (passes, m["peak_process_mb"])
        with peak_memory() as m:
            passes = [in_child(hf_padded, model_dir, n, args.dtype)]
        once["transformers_one_padded_batch"] = (passes, m["peak_process_mb"])

    def seconds_of(runs: dict, system: str) -> float:
        return statistics.median(runs[system][0])

    ours_s = statistics.median(seconds_of(runs, OURS) for runs in rounds)
    ours_mb = max(runs[OURS][1] for runs in rounds)
    results = {}  # system: seconds, every pass, peak MB, its time over ours, the rounds' such ratios
    for system in rounds[0]:
        ratios = [seconds_of(runs, system) / seconds_of(runs, OURS) for runs in rounds]
        results[system] = (statistics.median(seconds_of(runs, system) for runs in rounds),
                           [p for runs in rounds for p in runs[system][0]], max(runs[system][1] for runs in rounds),
                           statistics.median(ratios), ratios if system != OURS else None)
    for system, (passes, mb) in once.items():
        results[system] = (passes[0], passes, mb, passes[0] / ours_s, None)
    for system, (seconds, passes, mb, speedup, ratios) in results.items():
        emit(bench="ref_logprob", system=system, dtype=args.dtype, dp=args.dp, sequences=n, tokens=all_tokens,
             response_tokens=response_tokens, seconds=round(seconds, 2), passes=[round(p, 2) for p in passes],
             tokens_per_s=round(all_tokens / seconds, 1), peak_process_mb=round(mb, 1),
             rlhf_mc_speedup=round(speedup, 2), rlhf_mc_memory_ratio=round(ours_mb / mb, 2),
             mfu=round(flops / seconds / peak, 3), **({"rounds": [round(r, 2) for r in ratios]} if ratios else {}))
    emit(bench="ref_logprob", figure="ratio_at_peak", gflop=round(flops / 1e9, 1),
         value=round(results[SORTED][0] / (flops / peak), 2))


if __name__ == "__main__":
    main()
