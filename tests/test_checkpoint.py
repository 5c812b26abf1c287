"""Training checkpoints (model + distributed optimizer) across a restart: at TP=2 and at DP=2 (optimizer state
sharded over DP), three steps, save, a fresh model and optimizer load it, and the next two steps give the same losses
and weights as continuing without the restart. A save starts no process (Megatron's writer would serve its results
through a multiprocessing Manager: models/checkpoint.py)."""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.config import ParallelConfig
from rlhf_mc.runtime.spawn import spawn


def _run(tp: int, ckpt: str) -> dict:
    import multiprocessing

    from rlhf_mc.config import ModelConfig, OptimizerConfig
    from rlhf_mc.models.checkpoint import load_model, save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.train import sft_step

    parallel = ParallelConfig(tp=tp)
    init_parallel(parallel, seed=0)
    model = ModelConfig.from_yaml("model_configs/tiny-arith.yaml")
    optim = OptimizerConfig(lr=1e-2, weight_decay=0.1, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="cosine")
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    batches = [[torch.randint(3, 15, (10,), generator=g) for _ in range(8)] for _ in range(5)]

    def steps(state, which):
        return [sft_step(state, Trajectories.single_turn(batches[i], [6] * 8), 4096)["sft_loss"] for i in which]

    chunks = build_model(model, parallel)
    state = setup_training(chunks, optim)
    steps(state, range(3))
    save_model(chunks, ckpt, optimizer=state.optimizer)
    started = [p.name for p in multiprocessing.active_children()]
    scheduler = state.scheduler.state_dict()
    continued = steps(state, range(3, 5))
    weights = [p.detach().clone() for p in chunks[0].parameters()]

    fresh = build_model(model, parallel)
    restored = setup_training(fresh, optim)
    load_model(fresh, ckpt, optimizer=restored.optimizer)
    restored.scheduler.load_state_dict(scheduler)
    resumed = steps(restored, range(3, 5))
    gap = max((a - b.detach()).abs().max().item() for a, b in zip(weights, fresh[0].parameters()))
    return {"continued": continued, "resumed": resumed, "gap": gap, "started": started}


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_resume_matches_continuing(tp, tmp_path):
    for result in spawn(_run, 2, tp, str(tmp_path / "ckpt")):
        assert result["resumed"] == pytest.approx(result["continued"], abs=1e-6)
        assert result["gap"] < 1e-6
        assert result["started"] == []


def test_incomplete_checkpoints_are_removed_before_a_run_goes_on(tmp_path):
    """What a kill during a save leaves - a .tmp directory, a critic part whose actor part never completed - is
    removed; complete checkpoints (trainer_state.json in the actor part) and their critic parts stay."""
    from rlhf_mc.trainer import checkpoints

    root = tmp_path / "checkpoints"
    for name in ("step_000002", "step_000002_critic", "step_000004_critic", "step_000004.tmp", "step_000006.tmp"):
        (root / name).mkdir(parents=True)
    (root / "step_000002" / "trainer_state.json").write_text("{}")
    removed = checkpoints.remove_incomplete(tmp_path)
    assert sorted(p.name for p in removed) == ["step_000004.tmp", "step_000004_critic", "step_000006.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000002_critic"]
    assert checkpoints.resume_from(tmp_path, "auto") == root / "step_000002"
