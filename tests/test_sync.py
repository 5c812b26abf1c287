"""Weight sync from a TP=2 x PP=2 actor into SGLang engines at TP=1 and TP=2, after optimizer steps that change
the weights of every pipeline stage: each time, the engine's log-probs equal the actor's (1e-4, fp32) and its
samples carry the new version; at the end its greedy output equals transformers' on the actor's exported weights.
Ten more syncs show no memory growth."""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.config import ParallelConfig
from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.rollout.sglang_engine import LAUNCH_VERSION
from rlhf_mc.runtime.spawn import spawn

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [200, 3]]
STEPS, REPEATS = 3, 10


def _actor(model_dir: str, address: str, transport: str, export_dir: str) -> dict | None:
    import psutil

    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.safetensors_io import write_hf_checkpoint
    from rlhf_mc.bridge.weights import export_hf_weights, load_hf_weights
    from rlhf_mc.config import OptimizerConfig, RolloutConfig
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.rollout.sglang_engine import SGLangEngine
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.sync.weights import WeightSync, check_versions
    from rlhf_mc.workers.policy import compute_log_prob
    from rlhf_mc.workers.train import PolicyLossConfig, train_step

    parallel = ParallelConfig(tp=2, pp=2)
    init_parallel(parallel, seed=3)
    model = model_config_from_hf(read_hf_config(model_dir))
    chunks = build_model(model, parallel, init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    state = setup_training(chunks, OptimizerConfig(lr=2e-2, weight_decay=0.0))
    rank0 = torch.distributed.get_rank() == 0
    engine = SGLangEngine(RolloutConfig(addresses=(address,))) if rank0 else None
    sync = WeightSync(chunks, model, engine, transport, bucket_bytes=20_000)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.vocab_size, (n,), generator=g) for n in (14, 9, 20)]
    starts = [4, 3, 6]
    per_token = {"advantages": [torch.randn(len(s) - st, generator=g) for s, st in zip(seqs, starts)],
                 "old_logprobs": [torch.full((len(s) - st,), -5.5) for s, st in zip(seqs, starts)]}
    steps = []
    for version in range(1, STEPS + 1):
        train_step(state, seqs, starts, per_token, PolicyLossConfig(), micro_batch_tokens=64)
        stats = sync.sync(chunks, version)
        box = [None]
        if rank0:
            samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
            check_versions(samples, version)
            box = [[(s.response_ids, s.logprobs) for s in samples]]
        torch.distributed.broadcast_object_list(box, src=0)
        actor = compute_log_prob(chunks, [torch.tensor(p + r) for p, (r, _) in zip(PROMPTS, box[0])],
                                 [len(p) for p in PROMPTS])
        steps.append({"engine": box[0], "actor": [a["logprobs"] for a in actor], "stats": stats})
    rss = []
    for version in range(STEPS + 1, STEPS + 1 + REPEATS):
        sync.sync(chunks, version)
        rss.append(psutil.Process().memory_info().rss / 2**20)
    exported = list(pair for bucket in export_hf_weights(chunks, sync.plan, model) for pair in bucket)
    if not rank0:
        return None
    from pathlib import Path

    write_hf_checkpoint(iter(exported), Path(export_dir))
    return {"steps": steps, "rss_mb": rss, "version": engine.weight_version}


@pytest.fixture(scope="module")
def engine_tp2(tiny_hf_model, tmp_path_factory):
    """A second engine with TP=2 (each rank bound to its own core on CPU)."""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(RolloutConfig(model_path=str(tiny_hf_model), dtype="float32", tp=2),
                          log_dir=tmp_path_factory.mktemp("sglang_tp2_logs"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("transport, engine_tp", [("tensor", 1), ("distributed", 1), ("disk", 1), ("tensor", 2)])
def test_sync_follows_every_update(transport, engine_tp, request, tiny_hf_model, tmp_path):
    import shutil

    import transformers as T

    sglang_engine = request.getfixturevalue("sglang_engine" if engine_tp == 1 else "engine_tp2")
    export_dir = tmp_path / "actor"
    export_dir.mkdir()
    address = sglang_engine.urls[0].removeprefix("http://")
    try:
        result = spawn(_actor, 4, str(tiny_hf_model), address, transport, str(export_dir))[0]
        for step in result["steps"]:
            for (_, engine_lp), actor_lp in zip(step["engine"], step["actor"]):
                assert (torch.tensor(engine_lp) - actor_lp).abs().max().item() < 1e-4
            stats = step["stats"]
            assert stats.buckets > 1 and stats.bytes > 0 and stats.seconds > 0
        greedy_by_step = [[r for r, _ in step["engine"]] for step in result["steps"]]
        assert greedy_by_step[0] != greedy_by_step[-1], "the updates did not change the engine's output"
        growth = result["rss_mb"][-1] - result["rss_mb"][2]
        assert growth < 20, f"rank 0 grew {growth:.1f} MB over {REPEATS - 3} syncs: {result['rss_mb']}"
        assert result["version"] == STEPS + REPEATS

        shutil.copy2(tiny_hf_model / "config.json", export_dir / "config.json")
        model = T.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
        final = sglang_engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
        for prompt, sample in zip(PROMPTS, final):
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert sample.response_ids == out[0, len(prompt):].tolist()
    finally:
        sglang_engine.update_weights_from_disk(str(tiny_hf_model), version=LAUNCH_VERSION)
