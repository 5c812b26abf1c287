"""Held-out accuracy of an HF checkpoint directory with plain transformers (greedy `generate`), independent of the
trainer and its engines: the check that an exported model scores what the run logged.

    python tools/eval_hf.py --model runs/smollm2/final_hf --data recipes/data/word/test.jsonl [--chat-template]
                            [--max-new-tokens 48] [--reward math] [--limit N] [--batch 16]

Prints one JSON line: {"accuracy", "correct", "prompts", "seconds"}. Prompts are rendered as the trainer renders them
(data/dataset.encode_prompt: through the chat template when asked); the reward is a built-in rule or an import path,
as in a recipe's reward.function. Errors are one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mc.config import ConfigError  # noqa: E402


def evaluate(model_dir: str, data: str, chat_template: bool, max_new_tokens: int, reward: str, limit: int = 0,
             batch: int = 16) -> dict:
    import torch
    import transformers as T

    from rlhf_mc.data.dataset import encode_prompt, read_rows
    from rlhf_mc.rewards.scoring import resolve

    score = resolve(reward)
    tokenizer = T.AutoTokenizer.from_pretrained(model_dir)
    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = read_rows(data)[:limit or None]
    prompts = [encode_prompt(tokenizer, str(row["prompt"]), chat_template) for row in rows]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start, correct = time.perf_counter(), 0
    for i in range(0, len(rows), batch):
        group = prompts[i:i + batch]
        width = max(map(len, group))
        # left-padded, so that every prompt's continuation starts at the same column
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        for row, tokens in zip(rows[i:i + batch], out[:, width:].tolist()):
            if tokenizer.eos_token_id in tokens:
                tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
            response = tokenizer.decode(tokens, skip_special_tokens=True)
            correct += score(response, str(row["answer"]), str(row["prompt"])) >= 1.0
    return {"accuracy": correct / len(rows), "correct": int(correct), "prompts": len(rows),
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--data", required=True, help="jsonl/parquet with prompt and answer")
    parser.add_argument("--chat-template", action="store_true", help="render prompts with the model's template")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--reward", default="math", help="a built-in rule or package.module:function")
    parser.add_argument("--limit", type=int, default=0, help="the first N prompts (0: all)")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: --model: no HF checkpoint (config.json) at {args.model}", file=sys.stderr)
        return 2
    try:
        result = evaluate(args.model, args.data, args.chat_template, args.max_new_tokens, args.reward, args.limit,
                          args.batch)
    except (ConfigError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
