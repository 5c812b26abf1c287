"""One GRPO step by phase, ours vs TRL's GRPOTrainer (`pip install trl`) on the same model, prompts and batch, over
model sizes and response lengths: --prompts x --samples (32 x 8) of the quickstart's arithmetic data, one optimizer
step per batch, no KL term, both in --dtype (ours trains and rolls out in it; TRL, in bf16, autocasts: its default), our
micro-batch the whole batch as TRL's forward is (or --micro-batch-tokens). JSON lines per configuration: our phases
(median over the timed steps) with their achieved FLOP/s as a fraction of this machine's matmul FLOP/s in that dtype
(measured first), TRL's step time, the ratio, both steps' fraction of that peak and `ratio_at_peak`: TRL's step over a
step that ran every matmul at the peak (the most any system could gain over TRL on these cores).

    python bench/grpo_step.py [--sizes 1m 6m 50m] [--response-lengths 6 32 128] [--steps 6] [--warmup 1]
                              [--dtype float32] [--rounds 1] [--micro-batch-tokens N]
    python bench/grpo_step.py --model runs/models/SmolLM2-135M-Instruct --prompts 8 --samples 4 \
                              --response-lengths 32 --steps 4       # a real model: the word task, chat template

With --model (an HF checkpoint directory; tools/prepare_model.py makes SmolLM2-135M-Instruct's) both start from its
weights and take the real-model recipe's prompts (recipes/data/word, rendered with the model's chat template: TRL
gets them as conversations and applies the same template) instead of the random-init sizes.

With --rounds R each configuration runs ours then TRL R times in turn and reports the medians, the ratio being the
median of the rounds' ratios (each round's two systems minutes apart): on a shared VM whose speed drifts by 10-30%
from minute to minute, one round's ratio moves with the drift.

Both start from the same random-init HF checkpoint (the time of a step hardly depends on the weights) and every
response runs to the limit in both (ours: rollout.ignore_eos; TRL: min_new_tokens), so both do the same work. Ours
runs Ray + Megatron + SGLang on CPU; TRL runs transformers' generate and its trainer in a process of its own started
as our CPU ranks are (runtime/host.py's environment: on an AMD CPU MKL's AVX-512 kernels, glibc malloc settings - a
tuning any TRL user can apply the same way): the equal-environment baseline, the ratio this bench reports. With
--trl-plain TRL also runs in a plain process (what a user gets without that tuning), labelled so. TRL loads the
weights in float32 (explicitly: transformers would take the checkpoint's dtype) and, at --dtype bfloat16,
autocasts (its bf16=True); ours trains in --dtype itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit, in_child, llama_matmul_params, matmul_peak  # noqa: E402

LR = 1e-4
ARITH = REPO / "recipes/data/arith/train.jsonl"
WORD = REPO / "recipes/data/word/train.jsonl"
PROMPT_TOKENS = 8  # the longest arithmetic prompt (<= 7 characters) and BOS
# name: (hidden, layers, heads, kv heads, ffn); vocab 16 (the arithmetic characters)
SIZES = {"1m": (128, 4, 4, 2, 384), "6m": (256, 8, 8, 4, 768), "50m": (768, 8, 12, 6, 2304)}


def write_model_config(path: Path, size: str) -> int:
    """A llama-family model_configs YAML; returns its parameters that take part in every token's matmuls."""
    hidden, layers, heads, kv_heads, ffn = SIZES[size]
    head_dim = hidden // heads
    path.write_text(yaml.safe_dump(dict(
        family="llama", hidden_size=hidden, num_layers=layers, num_attention_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=16, max_position_embeddings=256, rope_theta=10000.0)))
    return llama_matmul_params(hidden, layers, heads, kv_heads, head_dim, ffn, vocab=16)


def real_model_config(model_dir: Path) -> tuple[int, int]:
    """(matmul parameters, the longest word-task prompt in tokens through the model's chat template) of an HF
    checkpoint directory."""
    import transformers as T

    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.data.dataset import encode_prompt, read_rows

    m = model_config_from_hf(read_hf_config(model_dir))
    tokenizer = T.AutoTokenizer.from_pretrained(model_dir)
    longest = max(len(encode_prompt(tokenizer, str(r["prompt"]), True)) for r in read_rows(WORD)[:512])
    return llama_matmul_params(m.hidden_size, m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim,
                               m.ffn_hidden_size, m.vocab_size), longest


def ours(run_dir: Path, model: list[str], batch: tuple[int, int], response_length: int, steps: int, warmup: int,
         dtype: str, micro_batch_tokens: int) -> dict:
    """Our phases' medians; `model`: the overrides that name the model (and its data)."""
    from rlhf_mc.trainer.loop import train
    from rlhf_mc.trainer.plan import make_plan
    from rlhf_mc.trainer.recipe import load_recipe, model_config

    prompts, n = batch
    recipe = load_recipe(REPO / "recipes/quickstart.yaml", [
        f"trainer.output_dir={run_dir}", *model, "sft.data_path=", "data.val_path=",
        f"trainer.total_steps={steps}", "trainer.save_interval=0", "trainer.export_hf=false",
        "trainer.loggers=[jsonl]", f"data.train_batch_size={prompts}", f"rollout.n={n}",
        f"actor.ppo_mini_batch_size={prompts}", f"data.max_response_length={response_length}",
        "rollout.ignore_eos=true", f"actor.optim.lr={LR}", f"model.dtype={dtype}", f"rollout.engine.dtype={dtype}",
        f"actor.micro_batch_tokens={micro_batch_tokens}"])
    train(recipe, make_plan(recipe, model_config(recipe)))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "timing/step_s" in r][warmup:-1]  # the last step also saves the final checkpoint
    keys = sorted({k for r in timed for k in r if k.startswith("timing/")} |
                  {"response/length_mean", "sequence/length_mean"})
    return {k: statistics.median(r.get(k, 0.0) for r in timed) for k in keys}


def trl_step(model_dir: Path, batch: tuple[int, int], response_length: int, steps: int, warmup: int, dtype: str,
             chat: bool) -> tuple[float, float | None]:
    """Median step seconds and mean completion length; `chat`: the word task's prompts as conversations (TRL
    renders them with the model's chat template, as data.chat_template does), else the arithmetic ones after BOS."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_mc.data.dataset import read_rows
    from rlhf_mc.rewards.rules import math_reward

    prompts, n = batch
    rows = read_rows(WORD if chat else ARITH)[:prompts * (steps + 1)]
    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}] if chat else "<s>" + r["prompt"], "answer": r["answer"]}
        for r in rows])

    def reward(completions, answer, **_):  # a conversation's completion is its one assistant message
        return [math_reward(c[0]["content"] if chat else c, a) for c, a in zip(completions, answer)]

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(output_dir=str(model_dir.parent / "trl"), use_cpu=True, per_device_train_batch_size=prompts * n,
                        gradient_accumulation_steps=1, num_generations=n, max_completion_length=response_length,
                        learning_rate=LR, max_steps=steps, beta=0.0, temperature=1.0, logging_steps=1,
                        report_to="none", save_strategy="no", loss_type="grpo", shuffle_dataset=False,
                        bf16=dtype == "bfloat16",  # TRL's default: bf16 autocast
                        generation_kwargs={"min_new_tokens": response_length})
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    return statistics.median(times[warmup:]), (round(statistics.mean(lengths), 1) if lengths else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["1m", "6m", "50m"])
    parser.add_argument("--response-lengths", nargs="+", type=int, default=[6, 32, 128])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians (compiling)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both systems': ours trains and rolls out in it, TRL autocasts to bf16 (its default)")
    parser.add_argument("--trl-plain", action="store_true",
                        help="also run TRL in a plain process (without our ranks' host tuning)")
    parser.add_argument("--rounds", type=int, default=1, help="ours and TRL in turn this many times (medians)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="our actor's micro-batch (default: the whole batch, TRL's one forward; at 57M / 128 "
                             "tokens two ranks of that and two engines exceed 24 GB)")
    parser.add_argument("--model", type=Path, default=None,
                        help="an HF checkpoint directory (the word task, chat template) instead of --sizes")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="per prompt")
    args = parser.parse_args()
    if args.steps < args.warmup + 2:  # ours leaves out its last step too (the final checkpoint is saved in it)
        parser.error(f"--steps {args.steps}: at least --warmup + 2 = {args.warmup + 2}")
    for name in ("rounds", "prompts", "samples", "micro_batch_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no HF checkpoint (config.json) there (tools/prepare_model.py)")
    try:
        import trl  # noqa: F401
    except ImportError:
        trl = None
        emit(figure="trl GRPOTrainer step", value=None, note="trl is not installed: pip install trl")
    peak = matmul_peak(args.dtype)
    batch = (args.prompts, args.samples)
    samples = args.prompts * args.samples
    chat = args.model is not None
    if chat:  # the same model and prompts at every response length
        params, prompt_tokens = real_model_config(args.model)
        # the real-model recipe's engine KV cache: SGLang's CPU default of 65536 tokens is 3 GB an engine at this
        # model's size
        model = ["model.config=", "model.tokenizer=", f"model.path={args.model}", f"data.train_path={WORD}",
                 "data.chat_template=true", f"data.max_prompt_length={prompt_tokens}",
                 "rollout.engine.max_total_tokens=8192"]
    for size in [args.model.name] if chat else args.sizes:
        for length in args.response_lengths:
            with tempfile.TemporaryDirectory() as tmp:
                if not chat:
                    model_yaml = Path(tmp) / "model.yaml"
                    params, prompt_tokens = write_model_config(model_yaml, size), PROMPT_TOKENS
                    model = [f"model.config={model_yaml}"]
                # by default the whole step's batch in one micro-batch, as TRL's one forward over
                # per_device_train_batch_size samples
                micro_batch_tokens = args.micro_batch_tokens or samples * (prompt_tokens + length)
                # per round: our phases, then TRL's (step seconds, mean completion length) as rank and, with
                # --trl-plain, in a plain process, in that order
                rounds, plain = [], []
                for r in range(args.rounds):
                    run_dir = Path(tmp) / f"ours{r}"
                    phases = ours(run_dir, model, batch, length, args.steps, args.warmup, args.dtype,
                                  micro_batch_tokens)
                    model_dir = args.model or run_dir / "init_hf"  # random init: the weights ours started from
                    trl_args = (model_dir, batch, length, args.steps, args.warmup, args.dtype, chat)
                    rounds.append((phases, *(in_child(trl_step, *trl_args, as_rank=True) if trl else (None, None))))
                    if trl and args.trl_plain:
                        plain.append(in_child(trl_step, *trl_args)[0])
                phases = {k: statistics.median(p[k] for p, _, _ in rounds) for k in rounds[0][0]}
                config = dict(size=size, dtype=args.dtype, params_m=round(params / 1e6, 2), prompts=args.prompts,
                              samples=args.samples, response_length=length, micro_batch_tokens=micro_batch_tokens,
                              response_length_mean=round(phases["response/length_mean"], 1),
                              sequence_length_mean=round(phases["sequence/length_mean"], 1))
                # tokens through the model per step: prompts and responses, every sample
                tokens = samples * phases["sequence/length_mean"]
                flops = {"timing/rollout_s": 2 * params * tokens, "timing/old_logprob_s": 2 * params * tokens,
                         "timing/ref_logprob_s": 2 * params * tokens, "timing/update_actor_s": 6 * params * tokens}
                for key, seconds in phases.items():
                    if key.startswith("timing/"):
                        mfu = round(flops[key] / seconds / peak, 4) if key in flops and seconds else None
                        emit(figure=f"ours {key}", **config, value=round(seconds, 4), unit="s", mfu=mfu)
                if trl is None:
                    continue
                step, trl_length = statistics.median(s for _, s, _ in rounds), rounds[0][2]
                ours_step = phases["timing/step_s"]
                ratios = [s / p["timing/step_s"] for p, s, _ in rounds]
                # both do one generation (2 x params x token) and one forward + backward (6 x) per token: the step's
                # fraction of the machine's matmul peak, and the ratio the peak itself allows over TRL
                step_flops = 8 * params * tokens
                figure = f"GRPO step, {args.prompts} prompts x {args.samples} samples, CPU"
                emit(figure=figure, **config, ours_s=round(ours_step, 3),
                     baseline="trl GRPOTrainer started as our CPU ranks (equal environment)", baseline_s=round(step, 3),
                     baseline_response_length=trl_length, ratio_baseline_over_ours=round(statistics.median(ratios), 2),
                     rounds=[{"ours_s": round(p["timing/step_s"], 3), "baseline_s": round(s, 3), "ratio": round(r, 2)}
                             for (p, s, _), r in zip(rounds, ratios)],
                     ours_step_mfu=round(step_flops / ours_step / peak, 3),
                     baseline_step_mfu=round(step_flops / step / peak, 3),
                     ratio_at_peak=round(step / (step_flops / peak), 2))
                if plain:
                    plain_step = statistics.median(plain)
                    emit(figure=figure, **config, ours_s=round(ours_step, 3),
                         baseline="trl GRPOTrainer in a plain process (a user's default, no host tuning)",
                         baseline_s=round(plain_step, 3), ratio_baseline_over_ours=round(plain_step / ours_step, 2),
                         baseline_step_mfu=round(step_flops / plain_step / peak, 3))


if __name__ == "__main__":
    main()
