"""Megatron distributed checkpoints (torch_dist) of model chunks, optionally with their optimizer: saved at one
TP/PP/VPP, loadable at any other. The optimizer state is stored in Megatron's "dp_reshardable" format: it resumes at
the same TP/PP (any DP).

Saving writes into `<dir>.tmp` and renames it to `<dir>` once every rank has finished, so a crash never leaves a
directory that looks complete.
"""

from __future__ import annotations

import queue
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


def _sharded_state_dict(chunks) -> dict:
    # The dict keys only give the structure; tensors are matched by their global ShardedTensor keys, so the
    # number of chunks (VPP) may differ between save and load.
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


# Each rank writes its own buffers, no communication. Megatron-Core 0.16's reshardable formats fail on CPU:
# "fully_reshardable" gathers over DP with hard-coded .cuda() calls, "fully_sharded_model_space" raises
# "ShardedTensor.flattened_range is not supported".
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _fill_fresh_optimizer_state(optimizer) -> None:
    """Megatron-Core 0.16's DistributedOptimizer.state_dict() asserts that torch Adam's per-parameter state (its
    "step") exists, which a fresh optimizer lacks until its first step: give it placeholder state (Megatron's own
    zero-gradient step) before loading. The parameters it may touch (weight decay) are loaded right after."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _state(chunks, optimizer, is_loading: bool) -> dict:
    state = _sharded_state_dict(chunks)
    if optimizer is not None:
        if is_loading:
            _fill_fresh_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT)
    return state


def _write_results_in_process() -> None:
    """Megatron's torch_dist writer hands each save's results back through a queue served by a multiprocessing
    Manager, made at the first save of a process: a spawned server process, a fresh interpreter (2.5 s of every
    rank's first save on 2 cores, measured), for a save that runs, as ours do, in the process that reads the
    results. A queue of this process holds them (the writer's threads, or its forked writers in Megatron-Core 0.16,
    report to the function that puts into it)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_model(chunks, path: str | Path, add_files: Callable[[Path], None] | None = None, optimizer=None) -> Path:
    """Saves the chunks' weights (and the Megatron optimizer's state, if given) to `path` (which must not exist).
    `add_files(dir)` runs on rank 0 before the rename, to put more files (metadata, tokenizer) into the
    checkpoint."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0:
        if path.exists():
            raise FileExistsError(f"checkpoint directory already exists: {path}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    _write_results_in_process()
    dist_checkpointing.save(_state(chunks, optimizer, is_loading=False), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        if add_files is not None:
            add_files(tmp)
        tmp.rename(path)
    dist.barrier()
    return path


def load_model(chunks, path: str | Path, optimizer=None) -> None:
    """Loads weights (and optimizer state) saved by save_model, at any parallel layout, into this rank's chunks."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"not a distributed checkpoint (no metadata.json): {path}")
    loaded = dist_checkpointing.load(_state(chunks, optimizer, is_loading=True), str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        with torch.no_grad():  # fp32 main params are views of the model's parameters (leaves that require grad)
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, loaded["optimizer"])


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """Megatron-Core 0.16's dp_reshardable load (torch Adam, no TE/apex) hands back each parameter's Adam "step" from
    the in-memory placeholder instead of the checkpoint (measured: 1.0 after 3 saved steps); the saved step is in
    the param groups. Adam's bias correction depends on it. One tensor per parameter: torch Adam increments it in
    place."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt, state in zip(chained, [loaded] if len(chained) == 1 else [loaded[i] for i in range(len(chained))]):
        steps = {g["step"] for g in state["optimizer"]["param_groups"] if "step" in g}
        if len(steps) == 1:
            step = float(steps.pop())
            for param_state in opt.optimizer.state.values():
                if "step" in param_state:
                    param_state["step"] = torch.tensor(step, dtype=torch.float32)
