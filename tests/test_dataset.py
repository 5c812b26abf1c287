"""Prompt datasets: jsonl and parquet rows, BOS and length filtering, and the step -> batch mapping a resumed run
relies on (a pure function of seed and step, every row once per epoch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_mc.config import ConfigError
from rlhf_mc.data.dataset import batch_for_step, load_prompts, load_sft, read_rows

REPO = Path(__file__).resolve().parents[1]
ARITH = REPO / "recipes/data/arith"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ARITH)


def test_batches_are_a_function_of_the_step():
    n, size = 50, 8  # 6 batches per epoch, 2 rows dropped
    epoch0 = [batch_for_step(n, size, step, seed=3, shuffle=True) for step in range(6)]
    rows = [r for _, batch in epoch0 for r in batch]
    assert len(rows) == 48 and len(set(rows)) == 48 and all(e == 0 for e, _ in epoch0)
    assert batch_for_step(n, size, 4, seed=3, shuffle=True) == epoch0[4]  # again, e.g. after a resume
    epoch1 = [batch_for_step(n, size, step, seed=3, shuffle=True)[1] for step in range(6, 12)]
    assert epoch1 != [b for _, b in epoch0] and batch_for_step(n, size, 6, 3, True)[0] == 1
    assert batch_for_step(n, size, 1, seed=3, shuffle=False)[1] == list(range(8, 16))
    with pytest.raises(ConfigError, match="data.train_batch_size: 64 exceeds the 50 usable prompts"):
        batch_for_step(n, 64, 0, 3, True)


def test_load_prompts_filters_and_counts(tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in [("1+2=", "3"), ("123+456=", "579")]))
    prompts, dropped = load_prompts(path, tokenizer, "q", "a", False, max_prompt_length=6)
    assert dropped == 1 and len(prompts) == 1
    p = prompts[0]
    assert p.ids == [tokenizer.bos_token_id] + tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    assert (p.row, p.text, p.answer) == (0, "1+2=", "3")
    with pytest.raises(ConfigError, match="row 0 has no key 'prompt'"):
        load_prompts(path, tokenizer, "prompt", "a", False, 6)
    with pytest.raises(ConfigError, match="no prompt of at most data.max_prompt_length=2 tokens"):
        load_prompts(path, tokenizer, "q", "a", False, 2)


def test_parquet_equals_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_rows(ARITH / "test.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    assert read_rows(tmp_path / "test.parquet") == rows
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: not JSON"):
        read_rows(tmp_path / "bad.jsonl")


def test_sft_examples_end_with_eos(tokenizer):
    examples = load_sft(ARITH / "sft.jsonl", tokenizer, "prompt", "response", False, 16)
    ids, mask = examples[0]
    start = mask.index(True)
    assert all(mask[start:])
    row = read_rows(ARITH / "sft.jsonl")[0]
    assert tokenizer.decode(ids[1:start]) == row["prompt"]
    assert tokenizer.decode(ids[start:-1]) == row["response"] and ids[-1] == tokenizer.eos_token_id


def test_shipped_task_is_reproducible(tmp_path):
    """tools/make_arith_task.py re-creates the shipped files byte for byte; train and test are disjoint."""
    import subprocess
    import sys

    subprocess.run([sys.executable, str(REPO / "tools/make_arith_task.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("sft.jsonl", "train.jsonl", "test.jsonl", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (ARITH / name).read_bytes(), name
    test = {r["prompt"] for r in read_rows(ARITH / "test.jsonl")}
    assert not test & {r["prompt"] for r in read_rows(ARITH / "train.jsonl")}


def test_prepare_gsm8k_from_local_files(tmp_path, tokenizer):
    """tools/prepare_data.py on GSM8K-format rows: the prompt file the recipes read, answers the math reward
    accepts; a row without a final answer is refused with its index."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    from prepare_data import main

    from rlhf_mc.rewards.rules import math_reward

    rows = [{"question": "Natalia sold 48 clips. How many?", "answer": "48/2 = 24\n#### 1,072"}]
    (tmp_path / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert main(["gsm8k", "--out", str(tmp_path / "out"), "--input", str(tmp_path / "train.jsonl")]) == 0
    (row,) = read_rows(tmp_path / "out" / "train.parquet")
    assert row["answer"] == "1072" and row["prompt"].startswith("Natalia sold 48 clips.")
    assert math_reward("so 1072 clips\n#### 1072", row["answer"]) == 1.0
    prompts, _ = load_prompts(tmp_path / "out" / "train.parquet", tokenizer, "prompt", "answer", False, 4096)
    assert prompts[0].answer == "1072"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "no final"}) + "\n")
    assert main(["gsm8k", "--out", str(tmp_path / "out2"), "--input", str(tmp_path / "bad.jsonl")]) == 2
    assert not (tmp_path / "out2").exists()


def test_sft_conversations_train_on_the_assistant_turns():
    """The tool recipe's demonstrations: tokenized as the rollouts hold them, the loss on the assistant turns."""
    from transformers import AutoTokenizer

    path = REPO / "recipes/data/calc/sft.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(path.parent)
    rows = read_rows(path)
    examples = load_sft(path, tokenizer, "prompt", "response", True, 64, "messages")
    assert len(examples) == len(rows)
    with_tool = next(i for i, row in enumerate(rows) if len(row["messages"]) == 4)
    ids, mask = examples[with_tool]
    user, call, result, answer = rows[with_tool]["messages"]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == \
        f"{call['content']}<|im_end|>{answer['content']}<|im_end|>"
    assert tokenizer.decode([t for t, m in zip(ids, mask) if not m]) == (
        f"<|im_start|>user\n{user['content']}<|im_end|>\n<|im_start|>assistant\n"
        f"\n<|im_start|>tool\n{result['content']}<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="row 0: 'prompt' must be a list of chat messages"):
        load_sft(path, tokenizer, "prompt", "response", True, 64, "prompt")


def test_shipped_tool_task_is_reproducible(tmp_path):
    """tools/make_tool_task.py re-creates recipes/data/calc byte for byte (the BPE tokenizer included)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, str(REPO / "tools/make_tool_task.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    calc = REPO / "recipes/data/calc"
    for path in sorted(calc.iterdir()):
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
