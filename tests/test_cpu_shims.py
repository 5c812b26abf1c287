"""Each Megatron-Core CPU shim, shown necessary: the same job fails without it, with the error it exists to fix.
(With all shims applied, these jobs run in test_parallel_parity.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig
from rlhf_mc.runtime import cpu
from rlhf_mc.runtime.spawn import spawn

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims apply only without CUDA")
CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"


def _train_step(parallel: ParallelConfig, model_name: str = "tiny-llama") -> float:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.models.pipeline import run_pipeline
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel

    model = ModelConfig.from_yaml(CONFIGS / f"{model_name}.yaml")
    init_parallel(parallel)
    state = setup_training(build_model(model, parallel), OptimizerConfig(lr=1e-3))
    tokens = torch.randint(0, model.vocab_size, (2, 16))
    batch = {"tokens": tokens, "labels": tokens, "position_ids": torch.arange(16).expand(2, 16)}
    state.zero_grad()
    run_pipeline(state.model, [batch], lambda mb, out: (out.sum(), {}), forward_only=False)
    return state.step()["grad_norm"]


NO_GPU = "Found no NVIDIA driver"
CASES = {
    # shim: (world size, layout, the Megatron code that fails without it, the error)
    "rng_tracker": (1, ParallelConfig(), "tensor_parallel/random.py", "in add", NO_GPU),
    "cuda_device_factories": (1, ParallelConfig(), "distributed/param_and_grad_buffer.py", "in __init__", NO_GPU),
    "optimizer_param_type_checks": (1, ParallelConfig(), "optimizer/distrib_optimizer.py",
                                    "in _build_model_and_main_param_groups",
                                    "TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor"),
    "rope_cp_slice": (2, ParallelConfig(cp=2), "embeddings/rope_utils.py", "in get_pos_emb_on_this_cp_rank", NO_GPU),
    "tied_embedding_sync": (2, ParallelConfig(pp=2), "language_module/language_module.py",
                            "in setup_embeddings_and_output_layer", NO_GPU),
    "moe_split_sizes_on_host": (2, ParallelConfig(ep=2), "tensor_parallel/mappings.py", "in forward",
                                "TypeError: all_to_all_single(): incompatible function arguments"),
}
MODELS = {"moe_split_sizes_on_host": "tiny-qwen3-moe"}  # the others: tiny-qwen3 (tied embeddings)


def test_every_shim_has_a_case():
    assert sorted(CASES) == sorted(cpu.SHIMS)


@pytest.mark.parametrize("shim", list(CASES))
def test_job_fails_without_shim(shim):
    world, parallel, megatron_file, function, error = CASES[shim]
    with pytest.raises(RuntimeError) as failure:
        spawn(_train_step, world, parallel, MODELS.get(shim, "tiny-qwen3"), skip_cpu_shims=(shim,))
    frames = re.findall(r'File "[^"]*/megatron/core/([^"]+)", line \d+, (in \w+)', str(failure.value))
    assert frames, "no Megatron frame in the traceback"
    failing_file, failing_function = frames[-1]
    assert failing_file.endswith(megatron_file) and failing_function == function, frames[-1]
    assert error in str(failure.value).rsplit('File "', 1)[-1]  # the exception, after the traceback's last frame


def test_unknown_shim_name_is_an_error():
    with pytest.raises(ValueError, match="unknown shim"):
        cpu.apply_megatron_shims(skip=("no_such_shim",))
