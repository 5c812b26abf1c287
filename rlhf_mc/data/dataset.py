"""Prompt datasets: rows from jsonl or parquet, tokenized once (optionally through the chat template), prompts over
the length limit dropped and counted; the order of every epoch is a function of (seed, epoch), so a resumed run
reads the same batches from the step number alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from rlhf_mc.config import ConfigError


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # the files read_rows reads


@dataclasses.dataclass(frozen=True)
class Prompt:
    row: int  # index of the row in the file
    text: str
    ids: list[int]
    answer: str


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in DATA_SUFFIXES:
        raise ConfigError(f"{path}: expected a {' or '.join(DATA_SUFFIXES)} file")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{i + 1}: not JSON ({e})") from None
    return rows


def _field(row: dict, key: str, path, i: int) -> str:
    if key not in row:
        raise ConfigError(f"{path}: row {i} has no key {key!r} (keys: {sorted(row)})")
    return str(row[key])


def encode_prompt(tokenizer, text: str, chat_template: bool, tools: list[dict] | None = None) -> list[int]:
    """The prompt's tokens: through the chat template as a user message (with the schemas of `tools`), or as is
    after the bos token."""
    if chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=tools,
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + list(ids)


def load_prompts(path, tokenizer, prompt_key: str, answer_key: str, chat_template: bool,
                 max_prompt_length: int, tools: list[dict] | None = None) -> tuple[list[Prompt], int]:
    """(prompts, number dropped for length)."""
    prompts, dropped = [], 0
    for i, row in enumerate(read_rows(path)):
        text = _field(row, prompt_key, path, i)
        ids = encode_prompt(tokenizer, text, chat_template, tools)
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        prompts.append(Prompt(i, text, ids, str(row.get(answer_key, ""))))
    if not prompts:
        raise ConfigError(f"{path}: no prompt of at most data.max_prompt_length={max_prompt_length} tokens")
    return prompts, dropped


def load_sft(path, tokenizer, prompt_key: str, response_key: str, chat_template: bool, max_length: int,
             messages_key: str = "", tools: list[dict] | None = None) -> list[tuple[list[int], list[bool]]]:
    """(token ids, loss mask) per row: prompt + response + eos with the loss on the response and eos; or, with
    `messages_key`, a conversation tokenized as the multi-turn rollouts hold it (data/chat.py) with the loss on its
    assistant turns. Rows over max_length are dropped."""
    from rlhf_mc.data.chat import Conversation

    chat = Conversation.of(tokenizer) if messages_key else None
    out = []
    for i, row in enumerate(read_rows(path)):
        if chat is not None:
            messages = row.get(messages_key)
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ConfigError(f"{path}: row {i}: {messages_key!r} must be a list of chat messages")
            ids, mask = chat.tokens(messages, tools)
        else:
            prompt = encode_prompt(tokenizer, _field(row, prompt_key, path, i), chat_template, tools)
            response = tokenizer(_field(row, response_key, path, i), add_special_tokens=False)["input_ids"]
            ids = prompt + list(response) + [tokenizer.eos_token_id]
            mask = [False] * len(prompt) + [True] * (len(ids) - len(prompt))
        if len(ids) <= max_length:
            out.append((ids, mask))
    if not out:
        raise ConfigError(f"{path}: no example of at most {max_length} tokens")
    return out


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch)).tolist()


def batch_for_step(n: int, batch_size: int, step: int, seed: int, shuffle: bool) -> tuple[int, list[int]]:
    """(epoch, row indices) of step `step` (0-based); the remainder of each epoch is dropped."""
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ConfigError(f"data.train_batch_size: {batch_size} exceeds the {n} usable prompts")
    epoch, offset = divmod(step, per_epoch)
    order = epoch_order(n, seed, epoch, shuffle)
    return epoch, order[offset * batch_size:(offset + 1) * batch_size]
