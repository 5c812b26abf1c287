"""The Transformer Engine layer spec against the local spec (same weights, fp32): equal logits.
Runs where TE imports (GPU machines, the Docker image); skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.models.gpt import te_available
from rlhf_mc.runtime.spawn import spawn

pytestmark = pytest.mark.skipif(not te_available(),
                                reason="Transformer Engine does not import here (it needs CUDA): TE spec not testable")
MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[1] / "model_configs" / "tiny-qwen3.yaml")


def _logits(use_te: bool, ckpt: str, save: bool) -> torch.Tensor:
    from rlhf_mc.models.checkpoint import load_model, save_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import device, init_parallel

    init_parallel(ParallelConfig(), seed=3)
    chunks = build_model(MODEL, ParallelConfig(), use_te=use_te)
    (save_model if save else load_model)(chunks, Path(ckpt) / "weights")
    (model,) = chunks
    tokens = torch.randint(0, MODEL.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(device())
    with torch.no_grad():
        return model(tokens, torch.arange(32, device=device()).expand(2, 32), None).float().cpu()


def test_te_spec_matches_local_spec(tmp_path):
    (local,) = spawn(_logits, 1, False, str(tmp_path), True)
    (te,) = spawn(_logits, 1, True, str(tmp_path), False)
    assert (local - te).abs().max().item() < 1e-4
