"""The SGLang side on a GPU (needs SGLang and torch_memory_saver: the Docker image; skipped on the lent GPU machine,
which has neither):

- colocated sync over CUDA IPC from an actor rank on the engine's own GPU: after each sync the engine's bf16
  log-probs of its greedy samples are within 0.05 (mean absolute, 0.5 max) of the actor's (bf16 kernels differ
  between SGLang and Megatron; fp32 matches to 1e-4 on CPU, tests/test_sync.py);
- release_memory frees the engine's weights and KV cache (torch.cuda.mem_get_info) and resume brings them back;
- NCCL broadcast sync (two GPUs: one per side);
- a fixed sampling seed reproduces samples (--enable-deterministic-inference, GPU attention backends only).
"""

from __future__ import annotations

import os

import pytest
import torch

from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.runtime.spawn import spawn
from tests.conftest import write_tiny_qwen2
from tests.gpu.conftest import gpus

pytest.importorskip("sglang", reason="SGLang is not installed here (it is in the Docker image)")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [200, 3]]
# The tiny model's head_dim is 16: SGLang's default backend on Hopper (fa3) takes head dims of 64 and up; the triton
# backend takes it (SGLang's own tests of small models run it).
BACKEND = ("--attention-backend", "triton")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen2(tmp_path_factory.mktemp("gpu_model") / "model", layers=4)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    pytest.importorskip("torch_memory_saver", reason="SGLang's memory saver needs the torch_memory_saver package")
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(RolloutConfig(model_path=str(model_dir), dtype="bfloat16", mem_fraction_static=0.3,
                                        extra_args=BACKEND),
                          log_dir=tmp_path_factory.mktemp("sglang_gpu_logs"), memory_saver=True)
    yield engine
    engine.shutdown()


def _actor(model_dir: str, address: str, transport: str) -> list[dict]:
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.config import OptimizerConfig, ParallelConfig, RolloutConfig
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.rollout.sglang_engine import SGLangEngine
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.sync.transports import connect
    from rlhf_mc.sync.weights import WeightSync, check_versions
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.policy import compute_log_prob
    from rlhf_mc.workers.train import sft_step

    init_parallel(ParallelConfig())
    model = model_config_from_hf(read_hf_config(model_dir))
    chunks = build_model(model, ParallelConfig(), dtype="bfloat16", init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    state = setup_training(chunks, OptimizerConfig(lr=1e-3, weight_decay=0.0))
    client = SGLangEngine(RolloutConfig(addresses=(address,)))
    sync = WeightSync(chunks, model, connect(transport, [address], [[0]]), bucket_bytes=2**20)
    g = torch.Generator().manual_seed(0)
    gaps = []
    for version in range(1, 4):
        sft_step(state, Trajectories.single_turn(
            [torch.randint(0, model.vocab_size, (32,), generator=g) for _ in range(4)], [8] * 4), 1024)
        stats = sync.sync(chunks, version)
        assert not stats.failed, stats.failed
        samples = client.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))
        check_versions([v for s in samples for v in s.versions], version)
        batch = Trajectories.single_turn([p + s.response_ids for p, s in zip(PROMPTS, samples)],
                                         [len(p) for p in PROMPTS])
        actor = batch.masked(compute_log_prob(chunks, batch)["logprobs"].float().cpu())
        diff = torch.cat([torch.tensor(s.logprobs) - a for s, a in zip(samples, actor)])
        gaps.append({"mean": diff.abs().mean().item(), "max": diff.abs().max().item()})
    return gaps


def test_colocated_cuda_ipc_sync_engine_equals_actor(engine, model_dir):
    gaps = spawn(_actor, 1, str(model_dir), engine.urls[0].removeprefix("http://"), "tensor", device="cuda")[0]
    for gap in gaps:
        assert gap["mean"] < 0.05 and gap["max"] < 0.5, gaps


def test_release_frees_engine_memory_and_resume_restores_it(engine):
    engine.update_weights_from_disk(engine.cfg.model_path, version=-1)
    before = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    released = torch.cuda.mem_get_info()[0]
    engine.resume_memory()
    total = torch.cuda.mem_get_info()[1]
    # mem_fraction_static=0.3 of the device: weights + KV cache; most of it must come back while released.
    assert released - free > 0.2 * total, (free, released, total)
    engine.update_weights_from_disk(engine.cfg.model_path, version=-1)  # released weights are not kept
    after = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    assert [s.response_ids for s in after] == [s.response_ids for s in before]


@pytest.mark.skipif(gpus() < 2, reason="NCCL needs a GPU per side: the actor's and the engine's")
def test_nccl_broadcast_sync(model_dir, tmp_path):
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the engine's device; the actor's rank takes GPU 0 below
    try:
        engine = SGLangEngine(RolloutConfig(model_path=str(model_dir), dtype="bfloat16", mem_fraction_static=0.3,
                                            extra_args=BACKEND),
                              log_dir=tmp_path)
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES")
    try:
        gaps = spawn(_actor, 1, str(model_dir), engine.urls[0].removeprefix("http://"), "distributed",
                     device="cuda")[0]
        for gap in gaps:
            assert gap["mean"] < 0.05 and gap["max"] < 0.5, gaps
    finally:
        engine.shutdown()


def test_fixed_seed_reproduces_samples(model_dir, tmp_path):
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(RolloutConfig(model_path=str(model_dir), deterministic=True, mem_fraction_static=0.3,
                                        extra_args=BACKEND),
                          log_dir=tmp_path)
    try:
        sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=7)
        first, second = engine.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling)
        assert [s.response_ids for s in first] == [s.response_ids for s in second]
        assert len({tuple(s.response_ids) for s in first if s.prompt_index == 0}) > 1
    finally:
        engine.shutdown()
