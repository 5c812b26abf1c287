"""The Transformer Engine layer spec against the local spec (same weights): equal fp32 logits at TP=1; at TP=2 with
sequence parallelism (on with TE at TP > 1), in bf16, through the packed log-prob path (sequences padded to a multiple
of TP, THD input: TE's fused attention, which has no fp32 kernel, so fp32 with TE takes our core attention), no
farther from the fp32 local spec than the bf16 local spec is; and the mixture-of-experts families against
transformers. Runs where TE imports (GPU machines, the Docker image); skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.models.gpt import te_available
from rlhf_mc.runtime.spawn import spawn
from tests.gpu.conftest import gpus

pytestmark = pytest.mark.skipif(not te_available(),
                                reason="Transformer Engine does not import here (it needs CUDA): TE spec not testable")
MODEL = ModelConfig.from_yaml(Path(__file__).resolve().parents[2] / "model_configs" / "tiny-qwen3.yaml")


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


def _logprobs(tp: int, use_te: bool, ckpt: str, dtype: str) -> list[torch.Tensor] | None:
    from rlhf_mc.models.checkpoint import load_model
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.policy import compute_log_prob

    init_parallel(ParallelConfig(tp=tp), seed=3)
    chunks = build_model(MODEL, ParallelConfig(tp=tp), dtype=dtype, use_te=use_te, init_weights=False)
    assert chunks[0].config.sequence_parallel == (use_te and tp > 1)
    load_model(chunks, Path(ckpt) / "weights")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, MODEL.vocab_size, (n,), generator=g) for n in (13, 30, 7)]  # lengths not multiples of tp
    batch = Trajectories.single_turn(seqs, [3, 10, 2])
    return batch.masked(compute_log_prob(chunks, batch)["logprobs"].cpu())


@pytest.mark.skipif(gpus() < 2, reason="TP=2 needs two GPUs")
def test_sequence_parallel_te_spec_matches_local_spec(tmp_path):
    spawn(_logits, 1, False, str(tmp_path), True)  # writes the weights
    reference = torch.cat(spawn(_logprobs, 1, 1, False, str(tmp_path), "float32")[0])
    local = torch.cat(spawn(_logprobs, 1, 1, False, str(tmp_path), "bfloat16")[0])
    sequence_parallel = torch.cat(spawn(_logprobs, 2, 2, True, str(tmp_path), "bfloat16")[0])
    local_gap, te_gap = (local - reference).abs().mean().item(), (sequence_parallel - reference).abs().mean().item()
    assert te_gap <= 1.5 * local_gap + 1e-3, (te_gap, local_gap)


def _te_moe(hf_dir: str) -> dict:
    """Logits of the HF model loaded into the TE spec (on this GPU), and whether the export gives back each tensor."""
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.safetensors_io import HFCheckpoint
    from rlhf_mc.bridge.weights import build_export_plan, export_hf_weights, load_hf_weights
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import device, init_parallel
    from tests.test_bridge import TOKENS

    init_parallel(ParallelConfig())
    model = model_config_from_hf(read_hf_config(hf_dir))
    (chunk,) = build_model(model, ParallelConfig(), use_te=True)
    load_hf_weights([chunk], hf_dir, model)
    chunk.eval()
    tokens = TOKENS.to(device())
    with torch.no_grad():
        logits = chunk(tokens, torch.arange(tokens.size(1), device=device()).expand_as(tokens), None).float().cpu()
    ckpt = HFCheckpoint(hf_dir)
    plan = build_export_plan([chunk], model)
    exported = {name: torch.equal(t.cpu(), ckpt.read(name)) for bucket in export_hf_weights([chunk], plan, model)
                for name, t in bucket}
    return {"logits": logits, "exported": exported, "names": ckpt.names()}


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_te_spec_moe_equals_transformers(family, tmp_path):
    """Mixture-of-experts through TE's layer spec: grouped-GEMM experts (parameters linear_fc1.weight<j>, which the
    bridge names by global expert), TE's MLA attention for DeepSeek-V3: logits equal transformers' (fp32) and the
    export gives every HF tensor back bitwise."""
    from tests.test_bridge import _hf_logits, _write_hf_model

    _write_hf_model(family, tmp_path)
    (result,) = spawn(_te_moe, 1, str(tmp_path), device="cuda")
    assert (result["logits"] - _hf_logits(tmp_path)).abs().max().item() < 1e-4
    assert sorted(result["exported"]) == result["names"] and all(result["exported"].values())
