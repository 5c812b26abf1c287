"""Writes the real-model recipe's task: short arithmetic word problems of one or two steps on numbers below 10 ("Mia
has 7 shells. She finds 5 more, then gives 3 away. How many shells does Mia have now?"), each asking for the answer
after "####", so the rule reward (rewards/rules.py: math) checks it exactly. Sized for SmolLM2-135M-Instruct, which
answers 12.5% of them (96 held-out prompts, greedy, tools/eval_hf.py); at two or three steps on numbers to 15 it
answered 3%. Reproducible from a seed; the held-out split shares no problem with the training one.

    python tools/make_word_task.py [--out recipes/data/word] [--seed 0] [--train 4000] [--test 200]
        [--answer number|sentence]

--answer sentence asks for one sentence with the number in words instead ("Mia has nine shells now."), which no rule
reward scores exactly: the judge recipe's task (recipes/grpo_smollm2_135m_judge.yaml, its data in
recipes/data/word_sentence).

Files: train.jsonl and test.jsonl with "prompt" (the problem and the instruction) and "answer" (the number). The
prompts are plain text: the recipe renders them with the model's own chat template (data.chat_template).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

INSTRUCTIONS = {"number": "Give only the final number after \"####\".",
                "sentence": "Answer in one short sentence, writing the number in words."}
NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Ben", "Ivy", "Max", "Lily", "Noah", "Emma", "Owen"]
THINGS = ["apples", "shells", "stickers", "marbles", "coins", "books", "pencils", "stamps", "cards", "cookies"]
PRONOUN = {"Mia": "She", "Ava": "She", "Zoe": "She", "Ivy": "She", "Lily": "She", "Emma": "She"}


def problem(rng: random.Random, answer: str = "number") -> tuple[str, int]:
    """One problem and its answer: a start, then one or two changes (finds / buys / gets more, gives / loses some),
    never below one."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    he = PRONOUN.get(name, "He")
    count = rng.randint(2, 9)
    parts = [f"{name} has {count} {thing}."]
    steps = []
    for _ in range(rng.randint(1, 2)):
        if count > 1 and rng.random() < 0.5:
            n = rng.randint(1, count - 1)
            steps.append(rng.choice(["gives {n} away", "loses {n}", "gives {n} to a friend"]).format(n=n))
            count -= n
        else:
            n = rng.randint(1, 9)
            steps.append(rng.choice(["finds {n} more", "buys {n} more", "gets {n} more"]).format(n=n))
            count += n
    parts.append(f"{he} {', then '.join(steps)}.")
    parts.append(f"How many {thing} does {name} have now? {INSTRUCTIONS[answer]}")
    return " ".join(parts), count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes/data/word"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--answer", choices=sorted(INSTRUCTIONS), default="number")
    args = parser.parse_args(argv)
    rng, seen, rows = random.Random(args.seed), set(), []
    while len(rows) < args.train + args.test:
        prompt, answer = problem(rng, args.answer)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": str(answer)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("test.jsonl", rows[:args.test]), ("train.jsonl", rows[args.test:])):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    print(f"wrote {out}: test.jsonl {args.test} rows, train.jsonl {args.train} rows")


if __name__ == "__main__":
    main()
