"""The actor's update alone, ours against what TRL's GRPOTrainer runs for it, in one process started as our CPU ranks
(equal environment): our train_step (Megatron, packed sequences, the vocabulary head at the positions that predict
response tokens, one on-policy optimizer step) against transformers' forward with `logits_to_keep` (TRL's), the
policy-gradient loss, backward and AdamW, on the same batch of random tokens shaped as the real-model bench's (32
sequences of 71 + 48 tokens by default) and the same weights. Alternated rounds after warm-up; JSON lines with both
medians and the ratio; `--profile` prints torch.profiler's table of each side's last step.

    .venv/bin/python bench/update_step.py --model runs/models/SmolLM2-135M-Instruct [--sequences 32] [--prompt 71]
                                          [--response 48] [--rounds 3] [--warmup 1] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402


def _batch(vocab: int, sequences: int, prompt: int, response: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (sequences, prompt + response), generator=g)
    advantages = torch.randn(sequences, response, generator=g)
    rollout_logprobs = -3 + torch.randn(sequences, response, generator=g)
    return tokens, advantages, rollout_logprobs


def _seconds(step, name: str, profile: bool) -> float:
    """One call of `step`, timed; with `profile`, under torch.profiler, whose table is printed."""
    if not profile:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    print(f"--- {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    return seconds


def both(model_dir: str, sequences: int, prompt: int, response: int, rounds: int, warmup: int, profile: bool
         ) -> dict:
    """Runs in a rank (runtime/spawn.py): both sides, each warmed up, then their rounds in turn."""
    import transformers as T

    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.config import OptimizerConfig, ParallelConfig, PolicyLossConfig
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.train import train_step

    config = model_config_from_hf(read_hf_config(model_dir))
    tokens, advantages, rollout_logprobs = _batch(config.vocab_size, sequences, prompt, response)
    init_parallel(ParallelConfig(), seed=1)
    chunks = build_model(config, ParallelConfig(), init_weights=False)
    load_hf_weights(chunks, model_dir, config)
    state = setup_training(chunks, OptimizerConfig(lr=1e-6, weight_decay=0.0))
    batch = Trajectories.single_turn(list(tokens), [prompt] * sequences,
                                     {"advantages": list(advantages), "rollout_logprobs": list(rollout_logprobs)})

    def ours():
        train_step(state, batch, PolicyLossConfig(), 1.0, sequences * (prompt + response))

    hf = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-6, weight_decay=0.0)
    mask = torch.ones_like(tokens)

    def theirs():  # TRL's _get_per_token_logps and loss at one iteration (the ratio's value is 1)
        logits = hf(input_ids=tokens, attention_mask=mask, logits_to_keep=response + 1).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, -response:, None])[..., 0]
        loss = -(torch.exp(logprobs - logprobs.detach()) * advantages).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    ours_s, theirs_s = [], []
    for _ in range(warmup):
        ours()
        theirs()
    for r in range(rounds):  # the last round profiled, where asked
        ours_s.append(_seconds(ours, "ours", profile and r == rounds - 1))
        theirs_s.append(_seconds(theirs, "transformers", profile and r == rounds - 1))
    return {"ours": ours_s, "theirs": theirs_s, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("runs/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=71)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from rlhf_mc.runtime.spawn import spawn

    (result,) = spawn(both, 1, str(args.model), args.sequences, args.prompt, args.response, args.rounds,
                      args.warmup, args.profile, timeout_s=3600)
    ours, theirs = statistics.median(result["ours"]), statistics.median(result["theirs"])
    emit(bench="update_step", figure="actor update (forward, backward, optimizer step)", model=args.model.name,
         sequences=args.sequences, prompt_tokens=args.prompt, response_tokens=args.response, dtype="float32",
         threads=result["threads"], value_s=round(ours, 3),
         baseline="transformers forward with logits_to_keep + backward + AdamW (TRL's update), same rank process",
         baseline_s=round(theirs, 3), ratio_baseline_over_ours=round(theirs / ours, 2),
         rounds=[{"ours_s": round(a, 3), "baseline_s": round(b, 3)} for a, b in zip(result["ours"], result["theirs"])])


if __name__ == "__main__":
    main()
