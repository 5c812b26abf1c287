"""Checkpoint conversion HF <-> Megatron distributed checkpoint, run as local multi-process jobs.

Everything that can be checked is checked in the calling process before any worker starts. Outputs are written under
a temporary name and renamed when complete.

A converted Megatron checkpoint directory holds the torch_dist files, `rlhf_mc.json` (model config, dtype, the
layout it was saved at) and `hf/` (the source config.json and tokenizer files, passed through to a later export).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from rlhf_mc.bridge.hf_config import check_matches, hf_config_from_model, model_config_from_hf, read_hf_config
from rlhf_mc.bridge.safetensors_io import HFCheckpoint, copy_passthrough_files, write_hf_checkpoint
from rlhf_mc.config import ModelConfig, ParallelConfig, from_dict
from rlhf_mc.runtime.spawn import spawn

METADATA = "rlhf_mc.json"


def _check_new_output(out: Path) -> None:
    if out.exists():
        raise FileExistsError(f"output already exists: {out}")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"output's parent directory does not exist: {out.parent}")


def model_config_for_hf(hf_dir: str | Path, model_config: str | Path | None = None) -> ModelConfig:
    """The model config of an HF checkpoint: derived from its config.json, or the given YAML checked against it."""
    hf = read_hf_config(hf_dir)
    if model_config is None:
        return model_config_from_hf(hf, name=Path(hf_dir).name)
    model = ModelConfig.from_yaml(model_config)
    check_matches(model, hf)
    return model


def check_hf_checkpoint(hf_dir: str | Path, model_config: str | Path | ModelConfig | None = None) -> ModelConfig:
    """What loading an HF checkpoint directory would refuse, found without loading it: no directory or config.json,
    an unreadable config, an unsupported architecture, a config that differs from `model_config` (a YAML or a
    ModelConfig), a missing, truncated or foreign weight file (every shard's header is read against its size).
    Returns the model config; raises ConfigError, FileNotFoundError or ValueError naming the path and the reason."""
    if not Path(hf_dir).is_dir():
        raise FileNotFoundError(f"{hf_dir}: no such directory")
    if isinstance(model_config, ModelConfig):
        model = model_config
        check_matches(model, read_hf_config(hf_dir))
    else:
        model = model_config_for_hf(hf_dir, model_config)
    HFCheckpoint(hf_dir)
    return model


def write_metadata(ckpt: Path, model: ModelConfig, dtype: str, parallel: ParallelConfig) -> None:
    """What makes a distributed checkpoint readable without its writer: the model config, the dtype, the layout it
    was saved at (hf_to_mcore's checkpoints and the trainer's: tools/score.py and mcore-to-hf read both)."""
    meta = {"model": dataclasses.asdict(model), "dtype": dtype, "saved_with": dataclasses.asdict(parallel)}
    (ckpt / METADATA).write_text(json.dumps(meta, indent=2) + "\n")


def read_metadata(ckpt: str | Path) -> tuple[ModelConfig, str]:
    """(model config, dtype) of a checkpoint written by hf_to_mcore."""
    path = Path(ckpt) / METADATA
    if not (Path(ckpt) / "metadata.json").is_file() or not path.is_file():
        raise FileNotFoundError(f"not an rlhf_mc distributed checkpoint (no metadata.json / {METADATA}): {ckpt}")
    meta = json.loads(path.read_text())
    return from_dict(ModelConfig, meta["model"], "model"), meta["dtype"]


def checkpoint_model_config(ckpt: str | Path) -> tuple[ModelConfig, str]:
    """(model config, dtype) of an HF checkpoint directory or of a distributed checkpoint written by hf_to_mcore."""
    ckpt = Path(ckpt)
    if (ckpt / METADATA).is_file():
        return read_metadata(ckpt)
    if (ckpt / "config.json").is_file():
        hf = read_hf_config(ckpt)
        return model_config_from_hf(hf, name=ckpt.name), "float32"
    raise FileNotFoundError(f"neither an HF checkpoint (config.json) nor an rlhf_mc checkpoint ({METADATA}): {ckpt}")


def load_weights(chunks, ckpt: str | Path, model: ModelConfig, progress: bool = False) -> None:
    """Loads either kind of checkpoint (see checkpoint_model_config) into this rank's chunks."""
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models.checkpoint import load_model

    if (Path(ckpt) / METADATA).is_file():
        load_model(chunks, ckpt)
    else:
        load_hf_weights(chunks, ckpt, model, progress=progress)


def hf_to_mcore(hf_dir: str | Path, out: str | Path, parallel: ParallelConfig, dtype: str = "float32",
                model_config: str | Path | None = None, progress: bool = True, device: str = "auto") -> Path:
    """`device`: where the ranks of the layout run (runtime.spawn: GPUs when there is one per rank, else the CPU)."""
    hf_dir, out = Path(hf_dir), Path(out)
    _check_new_output(out)
    model = check_hf_checkpoint(hf_dir, model_config)
    parallel.check_model(model)
    spawn(_hf_to_mcore_worker, parallel.min_world_size, str(hf_dir), str(out), model, parallel, dtype, progress,
          device=device)
    return out


def _hf_to_mcore_worker(hf_dir: str, out: str, model: ModelConfig, parallel: ParallelConfig, dtype: str,
                        progress: bool) -> None:
    import torch.distributed as dist

    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models.checkpoint import save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    init_parallel(parallel)
    chunks = build_model(model, parallel, dtype=dtype, init_weights=False)
    load_hf_weights(chunks, hf_dir, model, progress=progress and dist.get_rank() == 0)

    def add_files(tmp: Path) -> None:
        write_metadata(tmp, model, dtype, parallel)
        (tmp / "hf").mkdir()
        shutil.copy2(Path(hf_dir) / "config.json", tmp / "hf" / "config.json")
        copy_passthrough_files(Path(hf_dir), tmp / "hf")

    save_model(chunks, out, add_files=add_files)


def mcore_to_hf(ckpt: str | Path, out: str | Path, parallel: ParallelConfig | None = None,
                progress: bool = True, max_shard_bytes: int = 5 * 2**30, device: str = "auto") -> Path:
    """Exports a checkpoint written by hf_to_mcore (at any layout) as an HF checkpoint; loads at `parallel`
    (default TP=1, PP=1), on `device` (as hf_to_mcore)."""
    ckpt, out, parallel = Path(ckpt), Path(out), parallel or ParallelConfig()
    _check_new_output(out)
    model, _ = read_metadata(ckpt)
    parallel.check_model(model)
    spawn(_mcore_to_hf_worker, parallel.min_world_size, str(ckpt), str(out), parallel, progress,
          max_shard_bytes, device=device)
    return out


def _mcore_to_hf_worker(ckpt: str, out: str, parallel: ParallelConfig, progress: bool, max_shard_bytes: int) -> None:
    from rlhf_mc.models.checkpoint import load_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel

    model, dtype = read_metadata(ckpt)
    init_parallel(parallel)
    chunks = build_model(model, parallel, dtype=dtype, init_weights=False)
    load_model(chunks, ckpt)
    source = Path(ckpt) / "hf"
    config = read_hf_config(source) if (source / "config.json").is_file() else hf_config_from_model(model, dtype)
    write_hf_export(chunks, model, out, config, source, progress, max_shard_bytes)


def write_hf_export(chunks, model: ModelConfig, out: str | Path, config: dict, passthrough_from: Path | None = None,
                    progress: bool = False, max_shard_bytes: int = 5 * 2**30) -> None:
    """Collective over the model's ranks: rank 0 writes the chunks as an HF checkpoint with `config` (config.json)
    and the tokenizer files of `passthrough_from`, into `<out>.tmp`, renamed to `out` when complete."""
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from rlhf_mc.bridge.weights import build_export_plan, export_hf_weights

    plan = build_export_plan(chunks, model)
    # Tensors are written in the dtype the HF config declares (the source's), whatever dtype the model trained in.
    out_dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    tensors = ((name, tensor.to(out_dtype)) for bucket in export_hf_weights(chunks, plan, model)
               for name, tensor in bucket)
    if dist.get_rank() != 0:
        for _ in tensors:  # take part in the collectives
            pass
        return
    out, tmp = Path(out), Path(out).with_name(Path(out).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = sum(len(entry.rule.hf_names) for entry in plan.entries)
    write_hf_checkpoint(tqdm(tensors, total=names, desc="export HF weights", disable=not progress), tmp,
                        max_shard_bytes)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if passthrough_from is not None:
        copy_passthrough_files(passthrough_from, tmp)
    tmp.rename(out)

