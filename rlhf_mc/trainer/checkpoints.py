"""Where a run keeps its checkpoints: <output_dir>/checkpoints/step_<N> (+ step_<N>_critic), each complete once renamed
from its .tmp (models/checkpoint.py); resume=auto takes the newest complete one."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from rlhf_mc.config import ConfigError

_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def critic_dir(checkpoint: Path) -> Path:
    """The critic's part of a checkpoint, written before the actor's (whose trainer_state.json completes both)."""
    return checkpoint.with_name(checkpoint.name + "_critic")


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / "checkpoints"
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP.match(path.name)
        if match and (path / "trainer_state.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resume_from(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to continue from: resume=auto -> the newest complete one (None if there is none);
    never -> None; else a checkpoint path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(f"trainer.resume: {resume!r} is not a complete checkpoint (no trainer_state.json)")
    return path


def remove_incomplete(run_dir: Path) -> list[Path]:
    """What a run killed while writing a checkpoint left: `.tmp` directories, and a critic part whose actor part
    (written last) never completed. Removed before a run goes on, so the step can be saved again."""
    root = run_dir / "checkpoints"
    complete = {path.name for _, path in complete_checkpoints(run_dir)}
    left = [path for path in (root.iterdir() if root.is_dir() else ())
            if path.name.endswith(".tmp") or (path.name.endswith("_critic")
                                              and path.name.removesuffix("_critic") not in complete)]
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return left


def prune(run_dir: Path, keep: int) -> None:
    for _, path in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(critic_dir(path), ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
