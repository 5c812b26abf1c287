"""Rollout tokens/s through rlhf_mc's SGLang engine vs the raw SGLang server (one batched HTTP request, prompts
repeated n times) vs transformers' generate, same model and batch, in one invocation, for the model sizes of
bench/grpo_step.py (with a 2048-token vocabulary). Every response runs to --new-tokens in all three. Each side is
warmed up first (generate too, in its process: a short call before the timed one), and --rounds alternate the
sides (ours, raw, generate; medians over the rounds): on a shared VM whose speed drifts, one cold round in a fixed
order favours whoever runs at the fast moment. transformers' generate runs in a process started as our CPU ranks
and servers are (on an AMD CPU, MKL's AVX-512 kernels; runtime/host.py's malloc settings): the equal-environment
baseline the ratios are taken against; --plain adds a plain process (a user's default). With --engines N our
engine runs N data-parallel servers sharing the cores (as the quickstart's two on a 2-core machine), and the raw
baseline sends each server its share of the prompts at once. Prints JSON lines with the ratios.

    .venv/bin/python bench/rollout_throughput.py [--sizes 6m 50m --prompts 32 --n 8 --new-tokens 64 --engines 1]
                                                 [--rounds 3] [--plain]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, in_child  # noqa: E402
from bench.grpo_step import SIZES  # noqa: E402
from rlhf_mc.config import RolloutConfig  # noqa: E402
from rlhf_mc.rollout.base import SamplingParams  # noqa: E402
from rlhf_mc.rollout.sglang_engine import SGLangEngine  # noqa: E402


def write_model(out: Path, size: str):
    import transformers as T

    hidden, layers, heads, kv_heads, ffn = SIZES[size]
    config = T.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                           vocab_size=2048, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def hf_generate(model_dir: str, prompts: list[list[int]], n: int, new_tokens: int) -> tuple[float, int]:
    """Seconds and new tokens of one sampled transformers generate over every prompt's n samples, after a short
    warm-up call in the same process."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    batch = torch.tensor(prompts).repeat_interleave(n, dim=0)

    def generate(rows, tokens):
        with torch.no_grad():
            return model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=True, temperature=1.0,
                                  top_k=0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)

    generate(batch[:n], 4)
    start = time.perf_counter()
    out = generate(batch, new_tokens)
    return time.perf_counter() - start, (out.size(1) - batch.size(1)) * out.size(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["6m", "50m"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="the sides in turn this many times (medians)")
    parser.add_argument("--plain", action="store_true", help="also transformers' generate in a plain process")
    args = parser.parse_args()
    for size in args.sizes:
        measure(size, args)


def measure(size: str, args) -> None:
    prompts = torch.randint(0, 2048, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(1))
    prompts = prompts.tolist()
    common = dict(bench="rollout_throughput", size=size, prompts=args.prompts, n=args.n, new_tokens=args.new_tokens,
                  engines=args.engines)
    with tempfile.TemporaryDirectory() as tmp:
        params = write_model(Path(tmp) / "model", size)
        model_dir = str(Path(tmp) / "model")
        engine = SGLangEngine(RolloutConfig(model_path=model_dir, dtype="float32", num_engines=args.engines))
        sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)

        def ours() -> tuple[float, int]:
            engine.flush_cache()  # each timed run prefills its prompts
            start = time.perf_counter()
            samples = engine.generate(prompts, sampling)
            return time.perf_counter() - start, sum(len(s.response_ids) for s in samples)

        # SGLang's fastest form: each prompt repeated n times (with n > 1 it first caches each prompt in a
        # request of its own and waits for those; its tokenizer manager advises duplicating the prompts)
        def raw_generate(e: int) -> list[dict]:
            share = prompts[e::args.engines]
            payload = {"input_ids": [p for p in share for _ in range(args.n)], "return_logprob": True,
                       "sampling_params": {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}}
            return requests.post(engine.urls[e] + "/generate", json=payload, timeout=3600).json()

        def raw() -> tuple[float, int]:
            engine.flush_cache()  # else its prefill finds every prompt cached by ours
            with ThreadPoolExecutor(args.engines) as pool:
                start = time.perf_counter()
                out = [o for outs in pool.map(raw_generate, range(args.engines)) for o in outs]
                return time.perf_counter() - start, sum(len(o["output_ids"]) for o in out)

        sides = {"rlhf_mc_engine": ours, "sglang_raw_http": raw,
                 "transformers_generate_started_as_rlhf_mc_rank":
                     lambda: in_child(hf_generate, model_dir, prompts, args.n, args.new_tokens, as_rank=True)}
        if args.plain:
            sides["transformers_generate"] = lambda: in_child(hf_generate, model_dir, prompts, args.n, args.new_tokens)
        timed: dict[str, list[tuple[float, int]]] = {name: [] for name in sides}
        try:
            engine.generate(prompts[:2], sampling)  # warm-up (generate's is in its process)
            raw_generate(0)
            for _ in range(args.rounds):
                for name, side in sides.items():
                    timed[name].append(side())
        finally:
            engine.shutdown()

    tps = {name: statistics.median(tokens / seconds for seconds, tokens in runs) for name, runs in timed.items()}
    hf = tps["transformers_generate_started_as_rlhf_mc_rank"]
    for name, runs in timed.items():
        ratios = {"vs_transformers_equal_env": round(tps[name] / hf, 2)}
        if name == "rlhf_mc_engine":
            ratios["vs_sglang_raw"] = round(tps[name] / tps["sglang_raw_http"], 2)
        emit(**common, params=params, system=name, tokens=runs[0][1], rounds=args.rounds,
             seconds=[round(seconds, 2) for seconds, _ in runs], tokens_per_s=round(tps[name], 1), **ratios)


if __name__ == "__main__":
    main()
