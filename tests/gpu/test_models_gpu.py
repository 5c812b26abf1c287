"""Our models and training state on CUDA + NCCL (no SGLang needed; runs on the lent GPU machine):

- bf16 log-probs of every family on one GPU against transformers': Megatron-bf16 is no farther from the fp32
  reference (transformers, fp32) than transformers-bf16 is (x1.5 + 1e-3);
- offloading the training state frees its device memory (torch.cuda.mem_get_info), and the step after the reload
  equals one without offloading;
- a flattened bucket handed to another process over CUDA IPC (as the colocated sync does) is rebuilt there bitwise.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig
from rlhf_mc.runtime.spawn import spawn
from tests.test_bridge import FAMILIES, _write_hf_model

TOKENS = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(0))
STARTS = [8, 16, 24]


def _hf_logprobs(path: str, dtype: torch.dtype) -> list[torch.Tensor]:
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(TOKENS.cuda()).logits.float()
    lp = torch.log_softmax(logits, -1).gather(-1, TOKENS.cuda()[:, 1:, None])[..., 0].cpu()
    return [lp[i, start - 1:] for i, start in enumerate(STARTS)]


def _megatron_logprobs(path: str) -> list[torch.Tensor]:
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.policy import compute_log_prob

    init_parallel(ParallelConfig())
    model = model_config_from_hf(read_hf_config(path))
    chunks = build_model(model, ParallelConfig(), dtype="bfloat16", init_weights=False)
    load_hf_weights(chunks, path, model)
    batch = Trajectories.single_turn(list(TOKENS), STARTS)
    return [lp.float().cpu() for lp in batch.masked(compute_log_prob(chunks, batch)["logprobs"].cpu())]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logprobs_as_close_to_fp32_as_transformers_bf16(family, tmp_path):
    _write_hf_model(family, tmp_path)
    reference = torch.cat(_hf_logprobs(str(tmp_path), torch.float32))
    hf_bf16 = torch.cat(_hf_logprobs(str(tmp_path), torch.bfloat16))
    ours = torch.cat(spawn(_megatron_logprobs, 1, str(tmp_path), device="cuda")[0])
    hf_gap, our_gap = (hf_bf16 - reference).abs().mean().item(), (ours - reference).abs().mean().item()
    assert our_gap <= 1.5 * hf_gap + 1e-3, (our_gap, hf_gap)


MODEL = ModelConfig(family="qwen3", hidden_size=1024, num_layers=8, num_attention_heads=16, num_kv_heads=8,
                    head_dim=64, ffn_hidden_size=3072, vocab_size=32000, max_position_embeddings=2048, qk_norm=True)


def _steps(offload_between: bool) -> dict:
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.runtime.offload import offload_training_state, reload
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.train import sft_step

    init_parallel(ParallelConfig(), seed=0)
    chunks = build_model(MODEL, ParallelConfig(), dtype="bfloat16")
    state = setup_training(chunks, OptimizerConfig(lr=1e-5))
    g = torch.Generator().manual_seed(0)
    batch = Trajectories.single_turn([torch.randint(0, MODEL.vocab_size, (512,), generator=g) for _ in range(4)],
                                     [256] * 4)
    out = {"loss0": sft_step(state, batch, 4096)["sft_loss"]}
    if offload_between:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        saved = offload_training_state(chunks, state.optimizer, "all")
        out["freed"] = torch.cuda.mem_get_info()[0] - free_before
        out["state_bytes"] = sum(nbytes for _, nbytes, _ in saved)
        reload(saved)
    out["loss1"] = sft_step(state, batch, 4096)["sft_loss"]
    out["weights"] = torch.cat([p.detach().float().flatten()[:1000].cpu() for p in chunks[0].parameters()])
    return out


def test_offload_frees_device_memory_and_the_next_step_is_unchanged():
    (plain,) = spawn(_steps, 1, False, device="cuda")
    (offloaded,) = spawn(_steps, 1, True, device="cuda")
    assert offloaded["state_bytes"] > 1e9 and offloaded["freed"] >= 0.9 * offloaded["state_bytes"]
    assert offloaded["loss1"] == pytest.approx(plain["loss1"], rel=1e-6)
    assert torch.allclose(offloaded["weights"], plain["weights"], rtol=0, atol=1e-6)


def _receive(queue, done) -> None:
    """The engine side: rebuild the flattened bucket from the IPC handle, view the named tensors, report them."""
    torch.cuda.set_device(0)
    flat, metadata = queue.get()
    done.put([(name, flat[a:b].view(dtype).reshape(shape).cpu()) for name, dtype, shape, a, b in metadata])


def test_cuda_ipc_flattened_bucket_is_rebuilt_bitwise_in_another_process():
    import torch.multiprocessing as mp

    named = [("a", torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)),
             ("b", torch.randn(1000, device="cuda")), ("c", torch.randn(3, 7, device="cuda", dtype=torch.bfloat16))]
    ordered = sorted(named, key=lambda item: -item[1].element_size())  # as rollout.sglang_engine.tensor_payload
    parts = [t.flatten().view(torch.uint8) for _, t in ordered]
    flat, metadata, offset = torch.cat(parts), [], 0
    for (name, t), part in zip(ordered, parts):
        metadata.append((name, t.dtype, tuple(t.shape), offset, offset + part.numel()))
        offset += part.numel()
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receive, args=(queue, done))
    proc.start()
    queue.put((flat, metadata))
    received = dict(done.get(timeout=120))
    proc.join(timeout=60)
    for name, t in named:
        assert torch.equal(received[name], t.cpu()), name
