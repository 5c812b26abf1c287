"""HF safetensors checkpoints: a lazy reader of slices (single file or sharded with an index) and a sharded writer.

The reader opens every file named by the index up front, so a missing shard fails before any work; it then reads
only the requested slice of a tensor (safetensors' get_slice), so a rank's peak memory is its own shards plus one
slice.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files copied through from an HF checkpoint directory to an export (tokenizer, generation settings, ...).
PASSTHROUGH = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")


def _open(path: Path):
    """safe_open, its header checked against the file's size: a truncated or foreign file is a ValueError naming it."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a complete safetensors file ({e})") from None


class HFCheckpoint:
    """Read access to the tensors of an HF checkpoint directory."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX
        if index.is_file():
            self.file_of = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE).is_file():
            self.file_of = {name: SINGLE for name in _open(self.dir / SINGLE).keys()}
        else:
            raise FileNotFoundError(f"no {INDEX} or {SINGLE} in {self.dir}")
        missing = sorted({f for f in self.file_of.values() if not (self.dir / f).is_file()})
        if missing:
            raise FileNotFoundError(f"missing shard file {self.dir / missing[0]} (listed in {INDEX})")
        self._files = {f: _open(self.dir / f) for f in sorted(set(self.file_of.values()))}

    def _slice(self, name: str):
        if name not in self.file_of:
            raise KeyError(f"tensor {name} is not in the HF checkpoint {self.dir}")
        return self._files[self.file_of[name]].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        part = self._slice(name)
        if dim is None:
            return part[:]
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return part[index]

    def names(self) -> list[str]:
        return sorted(self.file_of)


def write_hf_checkpoint(tensors, out_dir: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes (name, tensor) pairs (an iterable, consumed once) as safetensors shards of at most
    `max_shard_bytes` plus an index; `out_dir` must exist and be empty."""
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files, weight_map, total = 0, [], {}, 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out_dir / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({t: name for t in shard})
            shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        shard_bytes += size
        total += size
    flush()
    # Rename to "-of-N" names once N is known, as transformers writes them.
    renamed = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    for old, new in renamed.items():
        (out_dir / old).rename(out_dir / new)
    index = {"metadata": {"total_size": total}, "weight_map": {t: renamed[f] for t, f in sorted(weight_map.items())}}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_passthrough_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in PASSTHROUGH:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
