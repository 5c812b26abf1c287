"""Multi-turn rollouts with tools, on the real SGLang engine (the shared CPU server) and the real Megatron actor.

The recorded trajectories are replayed through the actor: its log-prob of every sampled token equals the engine's
(1e-4, fp32), and the loss mask is 0 exactly on the inserted tokens, checked against what the engine returned turn
by turn and against the hand-written text of the template's tool turn. The model is the session's tiny random model
with its end-of-turn token made likely (so that turns end and conversations go on); a parser that reads a call in
every turn (the interface for other formats, by import path) makes every turn call the calculator."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_mc.config import ParallelConfig, ToolsConfig
from rlhf_mc.data.chat import Conversation
from rlhf_mc.data.dataset import Prompt
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.rollout.multi_turn import tool_loop
from rlhf_mc.rollout.sglang_engine import LAUNCH_VERSION
from rlhf_mc.runtime.spawn import spawn
from rlhf_mc.tools.executor import ToolExecutor
from rlhf_mc.tools.parsers import ToolCall

TOL = 1e-4
TOOL_TURN = ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"  # Qwen2.5's layout, by hand
             "<|im_start|>assistant\n")


def every_turn_calls(text: str) -> list[ToolCall]:
    return [ToolCall("calculator", {"expression": "6*7"})]


def _likely_end_of_turn(model_dir: Path, out: Path) -> Path:
    """The model with its eos (<|im_end|>, id 1) at p ~ 0.3 in every context: a constant residual direction that
    the eos row of the output layer reads."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[1, 0] = 2.0
    model.save_pretrained(out)
    return out


def _actor_logprobs(model_dir: str, batch: Trajectories) -> torch.Tensor:
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.workers.policy import compute_log_prob

    init_parallel(ParallelConfig(), seed=0)
    model = model_config_from_hf(read_hf_config(model_dir))
    chunks = build_model(model, ParallelConfig(), init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    return compute_log_prob(chunks, batch, micro_batch_tokens=256)["logprobs"]


def _runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """(mask value, start, end) of each run of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_multi_turn_trajectories_replay_through_the_actor(sglang_engine, tiny_hf_model, chat_tokenizer, tmp_path):
    model_dir = _likely_end_of_turn(tiny_hf_model, tmp_path / "model")
    chat = Conversation.of(chat_tokenizer)
    prompts = [Prompt(i, text, chat.prompt([{"role": "user", "content": text}]), "")
               for i, text in enumerate(["What is 6*7?", "Multiply six by seven, please."])]
    tools = ToolExecutor(ToolsConfig(functions=("rlhf_mc.tools.builtin:calculator",),
                                     parser="tests.test_multi_turn:every_turn_calls", max_turns=3, output_tokens=8))
    turns = []  # (prompt, response) of every request

    def generate(prompt_ids, sampling, sessions=None, max_new_tokens=None):
        out = sglang_engine.generate(prompt_ids, sampling, sessions, max_new_tokens)
        turns.extend((list(prompt_ids[s.prompt_index]), s.response_ids) for s in out)
        return out

    sglang_engine.update_weights_from_disk(str(model_dir), version=7)
    try:
        samples = tool_loop(generate, prompts, SamplingParams(n=3, max_new_tokens=200, stop_token_ids=(1,)),
                            chat_tokenizer, tools)
    finally:
        tools.close()
        sglang_engine.update_weights_from_disk(str(tiny_hf_model), version=LAUNCH_VERSION)
    assert len(samples) == 6 and sorted(s.prompt_index for s in samples) == [0, 0, 0, 1, 1, 1]
    assert max(s.stats["turns"] for s in samples) == 3, [s.stats for s in samples]
    for s in samples:
        prompt = prompts[s.prompt_index].ids
        assert s.tokens[:len(prompt)] == prompt and not any(s.loss_mask[:len(prompt)])
        runs = _runs(s.loss_mask)[1:]
        sampled = [(start, end) for m, start, end in runs if m]
        # every sampled run is one engine response, returned for exactly the tokens before it
        for start, end in sampled:
            assert (s.tokens[:start], s.tokens[start:end]) in turns
        # every inserted run is the template's tool turn, after a turn that ended at the end-of-turn token
        for m, start, end in runs:
            if not m:
                assert s.tokens[start - 1] == chat.end_of_turn
                assert chat_tokenizer.decode(s.tokens[start:end]) == TOOL_TURN
        assert len(sampled) == s.stats["turns"] == len(runs) - len(sampled) + 1  # inserted only between turns
        assert all(v == 7 for v, m in zip(s.versions, s.loss_mask) if m)
        assert [m["role"] for m in s.messages] == ["assistant", "tool"] * (len(sampled) - 1) + ["assistant"]
    batch = Trajectories.from_samples(samples, [0.0] * len(samples))
    actor = spawn(_actor_logprobs, 1, str(model_dir), batch)[0]
    mask = batch.loss_mask
    assert (actor[mask] - batch.fields["rollout_logprobs"][mask]).abs().max() < TOL
    assert (batch.fields["rollout_logprobs"][~mask] == 0).all()
