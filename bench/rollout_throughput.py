"""Rollout tokens/s through rlhf_mc's SGLang engine vs the raw SGLang server (one batched HTTP request, prompts
repeated n times) vs transformers' generate, same model and batch, in one invocation, for the model sizes of
bench/grpo_step.py (with a 2048-token vocabulary). Every response runs to --new-tokens in all three. generate runs in a plain process of its
own and in one started as our CPU ranks and servers are (on an AMD CPU, MKL's AVX-512 kernels, runtime/host.py): how
much of the ratio is the kernels and how much the rest. With --engines N our engine runs N data-parallel servers
sharing the cores (as the quickstart's two on a 2-core machine), and the raw baseline sends each server its share of
the prompts at once. Prints JSON lines with the ratios.

    .venv/bin/python bench/rollout_throughput.py [--sizes 6m 50m --prompts 32 --n 8 --new-tokens 64 --engines 1]
"""

from __future__ import annotations

import argparse
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
    """Seconds and new tokens of one sampled transformers generate over every prompt's n samples."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    batch = torch.tensor(prompts).repeat_interleave(n, dim=0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return time.perf_counter() - start, (out.size(1) - batch.size(1)) * out.size(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["6m", "50m"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--engines", type=int, default=1)
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
        engine = SGLangEngine(RolloutConfig(model_path=str(Path(tmp) / "model"), dtype="float32",
                                            num_engines=args.engines))
        try:
            sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
            engine.generate(prompts[:2], sampling)  # warm-up
            engine.flush_cache()  # each timed run prefills its prompts
            start = time.perf_counter()
            samples = engine.generate(prompts, sampling)
            ours_s = time.perf_counter() - start
            ours_tokens = sum(len(s.response_ids) for s in samples)

            # SGLang's fastest form: each prompt repeated n times (with n > 1 it first caches each prompt in a
            # request of its own and waits for those; its tokenizer manager advises duplicating the prompts)
            def raw_generate(e: int) -> list[dict]:
                share = prompts[e::args.engines]
                payload = {"input_ids": [p for p in share for _ in range(args.n)], "return_logprob": True,
                           "sampling_params": {"temperature": 1.0, "max_new_tokens": args.new_tokens,
                                               "ignore_eos": True}}
                return requests.post(engine.urls[e] + "/generate", json=payload, timeout=3600).json()

            engine.flush_cache()  # else its prefill finds every prompt cached by ours
            with ThreadPoolExecutor(args.engines) as pool:
                start = time.perf_counter()
                raw = [o for out in pool.map(raw_generate, range(args.engines)) for o in out]
                raw_s = time.perf_counter() - start
            raw_tokens = sum(len(o["output_ids"]) for o in raw)
        finally:
            engine.shutdown()

        hf_s, hf_tokens = in_child(hf_generate, str(Path(tmp) / "model"), prompts, args.n, args.new_tokens)
        rank_s, rank_tokens = in_child(hf_generate, str(Path(tmp) / "model"), prompts, args.n, args.new_tokens,
                                       as_rank=True)

    ours, raw_tps, hf, hf_rank = ours_tokens / ours_s, raw_tokens / raw_s, hf_tokens / hf_s, rank_tokens / rank_s
    emit(**common, params=params, system="transformers_generate", tokens=hf_tokens, seconds=round(hf_s, 2),
         tokens_per_s=round(hf, 1))
    emit(**common, params=params, system="transformers_generate_started_as_rlhf_mc_rank", tokens=rank_tokens,
         seconds=round(rank_s, 2), tokens_per_s=round(hf_rank, 1))
    emit(**common, params=params, system="sglang_raw_http", tokens=raw_tokens, seconds=round(raw_s, 2),
         tokens_per_s=round(raw_tps, 1), vs_transformers=round(raw_tps / hf, 2))
    emit(**common, params=params, system="rlhf_mc_engine", tokens=ours_tokens, seconds=round(ours_s, 2),
         tokens_per_s=round(ours, 1), vs_sglang_raw=round(ours / raw_tps, 2), vs_transformers=round(ours / hf, 2),
         vs_transformers_started_as_rank=round(ours / hf_rank, 2))


if __name__ == "__main__":
    main()
