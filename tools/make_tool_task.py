"""Writes the tool-use recipe's synthetic task (recipes/tool_calculator.yaml): multiplying a three-digit by a
two-digit number, which a tiny model cannot do in its head but can do with a calculator tool. Reproducible from a
seed; the repo ships the output in recipes/data/calc and this tool re-creates it.

    python tools/make_tool_task.py [--out recipes/data/calc] [--seed 0]

Files:
- tokenizer.json + tokenizer_config.json: a BPE tokenizer trained on the demonstrations, digits kept one per token
  (so that numbers are copied digit by digit), ChatML special tokens, <tool_call> / </tool_call>, and a ChatML chat
  template (user / assistant / tool roles, no system prompt: the model learns the tool from the demonstrations, which
  keeps the prompts short);
- sft.jsonl: conversations ("messages"); a share of them (--tool-share) calls the calculator in the Hermes format and
  answers with its result, the rest answer at once (and mostly wrongly, as a tiny model would): the warm-started
  model calls the tool only sometimes, and RL has something to learn;
- train.jsonl, test.jsonl: prompt/answer rows, problems disjoint from each other and from the demonstrations.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>"]
TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def tool_call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def conversation(a: int, b: int, with_tool: bool, rng: random.Random) -> list[dict]:
    user = {"role": "user", "content": f"{a}*{b}"}
    if not with_tool:  # a guess of the right size: what the model would write without the tool
        guess = a * b if rng.random() < 0.05 else rng.randrange(10 ** (len(str(a * b)) - 1), 10 ** len(str(a * b)))
        return [user, {"role": "assistant", "content": str(guess)}]
    return [user, {"role": "assistant", "content": tool_call(f"{a}*{b}")},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]


def write_tokenizer(out: Path, texts: list[str], vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>")
    fast.add_tokens(TOOL_TAGS)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes/data/calc"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", type=int, default=4000, help="demonstrations")
    parser.add_argument("--tool-share", type=float, default=0.2, help="share of demonstrations that call the tool")
    parser.add_argument("--test", type=int, default=200, help="held-out problems")
    parser.add_argument("--vocab-size", type=int, default=128)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    pool = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    rng.shuffle(pool)
    test, demos, train = pool[:args.test], pool[args.test:args.test + args.sft], pool[args.test + args.sft:]
    conversations = [conversation(a, b, rng.random() < args.tool_share, rng) for a, b in demos]
    texts = [m["content"] for c in conversations for m in c] + [tool_call("1*1")] + ["user\n", "assistant\n",
                                                                                      "tool\n"]
    write_tokenizer(out, texts, args.vocab_size)
    files = {"test.jsonl": [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in test],
             "train.jsonl": [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in train],
             "sft.jsonl": [{"messages": c} for c in conversations]}
    for name, rows in files.items():
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {out}: " + ", ".join(f"{name} {len(rows)} rows" for name, rows in files.items()))


if __name__ == "__main__":
    main()
