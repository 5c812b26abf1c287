"""The GPU figures, each against a baseline measured in the same run (JSON lines; tools/gpu_check.sh runs it on a
lent GPU machine: one GPU, no SGLang, Ray or Transformer Engine needed):

- matmul: bf16 8192^3 TFLOP/s, the peak that MFU figures divide by;
- train_step: Qwen3-0.6B (bf16, Megatron-Core on CUDA) SFT-step tokens/s and MFU (6 x params x tokens, plus
  attention, over the matmul peak);
- logprob_memory: peak device memory of compute_log_prob over one long sequence against the bytes of its full fp32
  logits (what a log_softmax over the whole vocabulary holds);
- offload: seconds to move the training state to pinned host memory and back, GB/s, and the device memory freed
  (torch.cuda.mem_get_info) against the state's bytes; and the plan's memory estimate of that rank's state
  (trainer/memory.py) against what the step left allocated;
- ipc_handover: a flattened weight bucket handed to another process over CUDA IPC and copied into its own tensor
  there (what an engine does with a colocated sync payload) against a device-to-device copy of the same bytes;
- rl_logprob / rl_update: the GPU side of bench/ref_logprob.py and of bench/grpo_step.py's update phase, on an RL
  batch (64-token prompts, responses of 32-512 tokens): our packed log-prob pass and GRPO-loss optimizer step against
  transformers on length-sorted padded micro-batches of 8 (the same model shape and dtype, SDPA attention).

    python bench/gpu_figures.py [--only NAME ...] [--context 32768] [--model model_configs/qwen3-0.6b.yaml]

A figure that fails prints its error as a JSON line and the others still run (a lent GPU machine's minutes are few).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, transformers_model  # noqa: E402
from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig  # noqa: E402
from rlhf_mc.runtime.spawn import spawn  # noqa: E402
from rlhf_mc.trainer.memory import trained_role  # noqa: E402
from rlhf_mc.trainer.recipe import TrainSection  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _timed(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / _timed(lambda: a @ b, 10, 3)


def _flops_per_token(model: ModelConfig, seq: int) -> float:
    """Forward + backward (x3 the forward): 2 x parameters of the matmuls, plus attention scores and values."""
    h, layers = model.hidden_size, model.num_layers
    q, kv = model.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    per_layer = 2 * (h * (q + 2 * kv) + q * h + 3 * h * model.ffn_hidden_size) + 2 * 2 * q * seq / 2  # causal
    return 3 * (layers * per_layer + 2 * h * model.vocab_size)


def train_step(model: ModelConfig, seq: int, batch: int, steps: int) -> dict:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.train import sft_step

    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(model, ParallelConfig(), dtype="bfloat16")
    state = setup_training(chunks, OptimizerConfig(lr=1e-5))
    g = torch.Generator().manual_seed(0)
    data = Trajectories.single_turn([torch.randint(0, model.vocab_size, (seq,), generator=g)
                                     for _ in range(batch)], [seq // 2] * batch)
    seconds = _timed(lambda: sft_step(state, data, seq * 2), steps, 1)
    tokens = seq * batch
    return {"tokens_per_s": tokens / seconds, "flops_per_s": tokens * _flops_per_token(model, seq) / seconds,
            "params": sum(p.numel() for p in chunks[0].parameters()), "seconds": seconds}


def logprob_memory(model: ModelConfig, context: int) -> dict:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.policy import compute_log_prob

    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(model, ParallelConfig(), dtype="bfloat16")
    seq = Trajectories.single_turn([torch.randint(0, model.vocab_size, (context,),
                                                  generator=torch.Generator().manual_seed(0))], [1])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    compute_log_prob(chunks, seq, micro_batch_tokens=context)
    torch.cuda.synchronize()
    return {"peak_extra_bytes": torch.cuda.max_memory_allocated() - base, "seconds": time.perf_counter() - start,
            "full_logits_bytes": context * model.vocab_size * 4}


def offload_figures(model: ModelConfig) -> dict:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.runtime.offload import offload_training_state, reload
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.train import sft_step

    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(model, ParallelConfig(), dtype="bfloat16")
    state = setup_training(chunks, OptimizerConfig(lr=1e-5))
    sft_step(state, Trajectories.single_turn([torch.randint(0, model.vocab_size, (1024,)) for _ in range(2)],
                                             [512] * 2), 2048)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()  # the training state, and what the step left cached for the next
    saved, out = [], {"offload_s": [], "reload_s": [], "freed": []}
    for _ in range(3):
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        saved = offload_training_state(chunks, state.optimizer, "all", reuse=saved)
        out["offload_s"].append(time.perf_counter() - start)
        out["freed"].append(torch.cuda.mem_get_info()[0] - free)
        start = time.perf_counter()
        reload(saved)
        out["reload_s"].append(time.perf_counter() - start)
    copied = sum(nbytes for _, nbytes, host in saved if host is not None)
    return {"state_bytes": sum(nbytes for _, nbytes, _ in saved), "copied_bytes": copied, "allocated_bytes": allocated,
            "freed_bytes": min(out["freed"]), "offload_s": statistics.median(out["offload_s"][1:]),
            "first_offload_s": out["offload_s"][0], "reload_s": statistics.median(out["reload_s"])}


def _rl_batch(model: ModelConfig, sequences: int):
    """64-token prompts and responses of 32-512 tokens (bench/ref_logprob.py's spread), GRPO fields on them."""
    from rlhf_mc.data.trajectory import Trajectories

    g = torch.Generator().manual_seed(0)
    responses = torch.randint(32, 513, (sequences,), generator=g).tolist()
    seqs = [torch.randint(0, model.vocab_size, (64 + r,), generator=g) for r in responses]
    return Trajectories.single_turn(seqs, [64] * sequences, {"advantages": [torch.randn(r, generator=g)
                                                                             for r in responses],
                                                              "rollout_logprobs": [-torch.rand(r, generator=g)
                                                                                   for r in responses]})


def rl_ours(model: ModelConfig, sequences: int, repeats: int) -> dict:
    """Seconds of our log-prob pass and of one GRPO-loss optimizer step over the batch (bf16, packed)."""
    from rlhf_mc.config import PolicyLossConfig
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob
    from rlhf_mc.workers.train import train_step

    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(model, ParallelConfig(), dtype="bfloat16")
    batch = _rl_batch(model, sequences)
    start = time.perf_counter()
    logprob = _timed(lambda: compute_log_prob(chunks, batch, micro_batch_tokens=16384), repeats, 1)
    print(f"# rl ours: log-probs {logprob:.3f} s, timed in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    state = setup_training(chunks, OptimizerConfig(lr=1e-6))
    update = _timed(lambda: train_step(state, batch, PolicyLossConfig(), micro_batch_tokens=16384), repeats, 1)
    return {"logprob_s": logprob, "update_s": update, "tokens": int(batch.lengths.sum())}


def rl_transformers(model_config: ModelConfig, sequences: int, repeats: int, micro_batch: int = 8) -> dict:
    """The same with transformers: length-sorted padded micro-batches, log_softmax + gather; the update adds the
    clipped-ratio loss of the responses, backward and AdamW."""
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized there: a 0.6B random init on the host takes long
        model = transformers_model(model_config)
    batch = _rl_batch(model_config, sequences)
    rows = sorted(zip(batch.rows(), batch.rows(batch.fields["advantages"])), key=lambda r: -len(r[0]))
    groups = [rows[i:i + micro_batch] for i in range(0, len(rows), micro_batch)]
    padded = []
    for group in groups:
        tokens = torch.zeros(len(group), len(group[0][0]), dtype=torch.long)
        mask, adv = torch.zeros_like(tokens), torch.zeros(len(group), len(group[0][0]))
        for i, (seq, a) in enumerate(group):
            tokens[i, :len(seq)], mask[i, :len(seq)], adv[i, :len(seq)] = seq, 1, a
        padded.append((tokens.cuda(), mask.cuda(), adv.cuda()))

    def logprobs(tokens, mask):
        logits = model(tokens, attention_mask=mask).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]

    def forward_only():
        with torch.no_grad():
            for tokens, mask, _ in padded:
                logprobs(tokens, mask)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    trained = sum(int(m[:, 64:].sum()) for _, m, _ in padded)

    def update():
        for tokens, mask, adv in padded:
            lp = logprobs(tokens, mask)[:, 63:]
            ratio = torch.exp(lp - lp.detach())
            weight = mask[:, 64:] / trained
            loss = -(torch.minimum(ratio * adv[:, 64:], ratio.clamp(0.8, 1.2) * adv[:, 64:]) * weight).sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return {"logprob_s": _timed(forward_only, repeats, 1), "update_s": _timed(update, repeats, 1)}


def _ipc_receiver(queue, done) -> None:
    torch.cuda.set_device(0)
    while True:
        item = queue.get()
        if item is None:
            return
        flat = item
        target = torch.empty_like(flat)
        torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(flat)
        torch.cuda.synchronize()
        done.put(time.perf_counter() - start)
        del flat, item


def ipc_handover(mb: int, repeats: int) -> dict:
    """Sender-side seconds from handing the bucket over to the receiver's copy being done, vs a local copy."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(queue, done))
    proc.start()
    total, copies = [], []
    try:
        for _ in range(repeats + 1):
            flat = torch.randint(0, 255, (mb * 2**20,), dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            start = time.perf_counter()
            queue.put(flat)
            copies.append(done.get(timeout=120))
            total.append(time.perf_counter() - start)
            del flat
            torch.cuda.ipc_collect()
    finally:
        queue.put(None)
        proc.join(timeout=60)
    source = torch.randint(0, 255, (mb * 2**20,), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    local = _timed(lambda: target.copy_(source), repeats)
    return {"handover_s": statistics.median(total[1:]), "receiver_copy_s": statistics.median(copies[1:]),
            "local_copy_s": local, "bytes": mb * 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = ["matmul", "rl", "train_step", "logprob_memory", "offload", "ipc_handover"]  # run in this order
    parser.add_argument("--only", nargs="*", choices=names, default=names)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--model", type=Path, default=REPO / "model_configs" / "qwen3-0.6b.yaml")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        emit(bench="gpu_figures", skipped="no CUDA device")
        return
    model, name = ModelConfig.from_yaml(args.model), args.model.stem
    emit(bench="gpu_figures", figure="device", name=torch.cuda.get_device_name(), torch=torch.__version__,
         megatron_core=__import__("megatron.core").core.__version__)
    peak = matmul_peak()

    def matmul():
        emit(bench="gpu_figures", figure="matmul_bf16_tflops", value=round(peak / 1e12, 1))

    def train():
        (r,) = spawn(train_step, 1, model, 4096, 8, 5, device="cuda")
        emit(bench="gpu_figures", figure="train_step_tokens_per_s", model=name, params=r["params"],
             seq=4096, batch=8, value=round(r["tokens_per_s"]), mfu=round(r["flops_per_s"] / peak, 3),
             baseline="matmul peak", peak_tflops=round(peak / 1e12, 1))

    def memory():
        (r,) = spawn(logprob_memory, 1, model, args.context, device="cuda")
        emit(bench="gpu_figures", figure="logprob_peak_memory_mb", context=args.context,
             value=round(r["peak_extra_bytes"] / 2**20), baseline=round(r["full_logits_bytes"] / 2**20),
             ratio=round(r["peak_extra_bytes"] / r["full_logits_bytes"], 3), seconds=round(r["seconds"], 2))

    def offload():
        (r,) = spawn(offload_figures, 1, model, device="cuda")
        emit(bench="gpu_figures", figure="offload_freed_mb", value=round(r["freed_bytes"] / 2**20),
             baseline=round(r["state_bytes"] / 2**20), ratio=round(r["freed_bytes"] / r["state_bytes"], 3))
        # the plan's estimate of the same rank's state (trainer/memory.py) against what the step left allocated
        estimate = trained_role("actor", TrainSection(), model, "bfloat16", 1).total
        emit(bench="gpu_figures", figure="memory_estimate_mb", model=name, value=round(estimate / 2**20),
             baseline="torch.cuda.memory_allocated after a step", baseline_mb=round(r["allocated_bytes"] / 2**20),
             ratio=round(r["allocated_bytes"] / estimate, 3), offloaded_state_mb=round(r["state_bytes"] / 2**20))
        emit(bench="gpu_figures", figure="offload_seconds", offload=round(r["offload_s"], 3),
             reload=round(r["reload_s"], 3), first_offload=round(r["first_offload_s"], 3),
             gb_per_s=round(r["copied_bytes"] / 2**30 / r["offload_s"], 1))

    def ipc():
        r = ipc_handover(1024, 5)
        gb = r["bytes"] / 2**30
        emit(bench="gpu_figures", figure="ipc_handover_gb_per_s", value=round(gb / r["handover_s"], 1),
             baseline=round(gb / r["local_copy_s"], 1), ratio=round(r["local_copy_s"] / r["handover_s"], 3),
             receiver_copy_gb_per_s=round(gb / r["receiver_copy_s"], 1))

    def rl():
        (ours,) = spawn(rl_ours, 1, model, 256, 3, device="cuda")
        (theirs,) = spawn(rl_transformers, 1, model, 256, 3, device="cuda")
        for phase in ("logprob", "update"):
            emit(bench="gpu_figures", figure=f"rl_{phase}_seconds", model=name, sequences=256,
                 tokens=ours["tokens"], value=round(ours[f"{phase}_s"], 3),
                 baseline="transformers, length-sorted micro-batches of 8", baseline_s=round(theirs[f"{phase}_s"], 3),
                 speedup=round(theirs[f"{phase}_s"] / ours[f"{phase}_s"], 2))

    figures = {"matmul": matmul, "train_step": train, "logprob_memory": memory, "offload": offload,
               "ipc_handover": ipc, "rl": rl}
    failed = 0
    for figure in args.only:
        start = time.perf_counter()
        try:
            figures[figure]()
        except Exception as error:  # noqa: BLE001 - the next figure still runs; the exit status says one failed
            failed += 1
            emit(bench="gpu_figures", figure=figure, error=f"{type(error).__name__}: {str(error)[-400:]}",
                 traceback_tail=traceback.format_exc().splitlines()[-8:])
        print(f"# {figure}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
