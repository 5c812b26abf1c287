"""Writes the quickstart's synthetic task: a character-level tokenizer (HF format) and prompt files for two-number
addition ("37+48=" -> "85"), reproducibly from a seed. The repo ships the output in recipes/data/arith; this tool
re-creates it.

    python tools/make_arith_task.py [--out recipes/data/arith] [--digits 2] [--seed 0]

Files: tokenizer.json + tokenizer_config.json (AutoTokenizer loads them), sft.jsonl (prompt/response
demonstrations), train.jsonl and test.jsonl (prompt/answer; disjoint problems).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHARS = "0123456789+="
SPECIAL = ["<pad>", "<s>", "</s>"]


def write_tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def problems(rng: random.Random, digits: int) -> list[tuple[int, int]]:
    top = 10 ** digits
    every = [(a, b) for a in range(top) for b in range(top)]
    rng.shuffle(every)
    return every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes/data/arith"))
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", type=int, default=4000, help="SFT demonstrations")
    parser.add_argument("--test", type=int, default=200, help="held-out problems")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    pool = problems(random.Random(args.seed), args.digits)
    test, rest = pool[:args.test], pool[args.test:]
    files = {"test.jsonl": [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in test],
             "train.jsonl": [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in rest],
             "sft.jsonl": [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in rest[:args.sft]]}
    for name, rows in files.items():
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {out}: " + ", ".join(f"{name} {len(rows)} rows" for name, rows in files.items()))


if __name__ == "__main__":
    main()
