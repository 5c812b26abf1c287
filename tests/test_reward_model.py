"""The reward model worker's scores equal transformers' sequence-classification scores of the same checkpoint
(TP=1 and TP=2), and a recipe refuses a checkpoint that is not a one-label classifier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_mc.runtime.spawn import spawn

SEQS = [[5, 9, 17, 33, 2], [7, 7, 8], [100, 3, 200, 4, 5, 6, 7, 8, 9]]


def write_reward_model(out: Path, num_labels: int = 1) -> Path:
    from tests.conftest import write_tiny_qwen2

    return write_tiny_qwen2(out, seed=1, reward_labels=num_labels)


def _scores(model_dir: str, tp: int) -> list[float]:
    """What the trainer's reward-model worker group does (trainer/loop.py score): a value-head model loads the
    checkpoint's score.weight, and a sequence's score is the head's output at its last token."""
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.config import ParallelConfig
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.policy import compute_values

    model = model_config_from_hf(read_hf_config(model_dir))
    init_parallel(ParallelConfig(tp=tp), seed=0)
    chunks = build_model(model, ParallelConfig(tp=tp), value_head=True)
    load_hf_weights(chunks, model_dir, model, value_head_from="score.weight")
    batch = Trajectories.single_turn([s + [0] for s in SEQS], [len(s) for s in SEQS])
    return [v[0].item() for v in batch.masked(compute_values(chunks, batch)["values"])]


@pytest.mark.parametrize("tp", [1, 2])
def test_reward_model_matches_transformers(tp, tmp_path):
    import transformers as T

    model_dir = write_reward_model(tmp_path / "rm")
    ours = spawn(_scores, tp, str(model_dir), tp)[0]
    reference = T.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [reference(torch.tensor([s])).logits[0, 0].item() for s in SEQS]
    assert ours == pytest.approx(expected, abs=1e-4)
    assert max(expected) - min(expected) > 0.1  # the scores differ between sequences: a real check


def test_recipe_refuses_non_reward_checkpoint(tmp_path, tiny_hf_model):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    write_reward_model(tmp_path / "two_labels", num_labels=2)
    for path, message in ((tiny_hf_model, "is not a one-label sequence-classification checkpoint"),
                          (tmp_path / "two_labels", "is not a one-label sequence-classification checkpoint"),
                          (tmp_path / "none", f"reward.model: not found: {tmp_path / 'none'}")):
        result = subprocess.run([sys.executable, "tools/launch.py", "recipes/quickstart.yaml",
                                 f"trainer.output_dir={tmp_path / 'run'}", f"reward.model={path}"],
                                cwd=repo, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr
