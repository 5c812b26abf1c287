"""Megatron distributed checkpoints (torch_dist) of model chunks: saved at one TP/PP/VPP, loadable at any other.

Saving writes into `<dir>.tmp` and renames it to `<dir>` once every rank has finished, so a crash never leaves a
directory that looks complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist


def _sharded_state_dict(chunks) -> dict:
    # The dict keys only give the structure; tensors are matched by their global ShardedTensor keys, so the
    # number of chunks (VPP) may differ between save and load.
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_model(chunks, path: str | Path, add_files: Callable[[Path], None] | None = None) -> Path:
    """Saves the chunks' weights to `path` (which must not exist). `add_files(dir)` runs on rank 0 before the
    rename, to put more files (metadata, tokenizer) into the checkpoint."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0:
        if path.exists():
            raise FileExistsError(f"checkpoint directory already exists: {path}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(chunks), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        if add_files is not None:
            add_files(tmp)
        tmp.rename(path)
    dist.barrier()
    return path


def load_model(chunks, path: str | Path) -> None:
    """Loads weights saved by save_model (at any parallel layout) into this rank's chunks."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"not a distributed checkpoint (no metadata.json): {path}")
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks), str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])
