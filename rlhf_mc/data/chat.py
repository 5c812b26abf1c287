"""Token-exact conversations through a chat template (DESIGN.md, "Multi-turn token exactness").

A trajectory's tokens are never a re-rendering of the conversation: the model's turns are the tokens it sampled, and
what comes between them (tool results, user messages) is tokenized as the difference between two renderings of a
fixed stand-in conversation: `render(base + messages, generation prompt) - render(base)`. Templates close an
assistant turn with more than its end-of-turn token (ChatML writes "<|im_end|>\\n"); the model stops at the
end-of-turn token, so the rest of that closing text ("\\n") is inserted before the next message. Dropping it is the
classic drift: every later turn would then be conditioned on a context the template never produces.

Every assumption is checked on the tokenizer's own template when a Conversation is made: a template that renders
a prefix differently once more messages follow, or that does not end an assistant turn with its end-of-turn token,
is refused with a message that says which.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from rlhf_mc.config import ConfigError

_BASE = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]  # the fixed stand-in


def _render(tokenizer, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=False))


def _tail(full: list[int], prefix: list[int], what: str) -> list[int]:
    if full[:len(prefix)] != prefix:
        raise ConfigError(f"chat template: rendering {what} changes the tokens before it, so a conversation cannot "
                          "be extended token by token")
    return full[len(prefix):]


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A tokenizer's chat template, taken apart for token-exact turns. `end_of_turn` is the token that ends an
    assistant turn (the tokenizer's eos); `after_turn` the template's tokens after it."""

    tokenizer: object
    end_of_turn: int
    after_turn: tuple[int, ...]
    base: tuple[int, ...]  # the stand-in conversation, rendered: what insert() subtracts

    @staticmethod
    def of(tokenizer) -> "Conversation":
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("data.chat_template: the tokenizer has no chat template; multi-turn rollouts need one")
        eos = tokenizer.eos_token_id
        opened, base = _render(tokenizer, _BASE[:1], True), _render(tokenizer, _BASE, False)
        closed = _tail(base, opened, "an assistant message")
        if eos not in closed:
            raise ConfigError(f"chat template: an assistant turn does not end with the eos token "
                              f"{tokenizer.eos_token!r} (rendered {tokenizer.decode(closed)!r}); the model's turns "
                              "could not end")
        end = len(closed) - 1 - closed[::-1].index(eos)
        return Conversation(tokenizer, eos, tuple(closed[end + 1:]), tuple(base))

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation so far, rendered, with the generation prompt: where the first sampled turn starts."""
        return _render(self.tokenizer, messages, True, tools)

    def insert(self, messages: Sequence[dict]) -> list[int]:
        """The tokens that follow an assistant turn ended by `end_of_turn`: the rest of the template's closing text,
        `messages` (tool results, user turns) and the next generation prompt."""
        full = _render(self.tokenizer, _BASE + list(messages), True)
        return list(self.after_turn) + _tail(full, list(self.base), f"{[m['role'] for m in messages]} messages")

    def assistant(self, content: str) -> list[int]:
        """An assistant turn as the model samples it: its content's tokens and the end-of-turn token."""
        return list(self.tokenizer(content, add_special_tokens=False)["input_ids"]) + [self.end_of_turn]

    def tokens(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
        """A whole conversation (a demonstration) as the rollouts would hold it: (tokens, loss mask), the mask on the
        assistant turns' tokens. The conversation starts with one or more non-assistant messages."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if not first:
            raise ConfigError(f"conversation: needs a non-assistant message before the first assistant one, got "
                              f"roles {[m['role'] for m in messages]}")
        tokens = self.prompt(messages[:first], tools)
        mask = [False] * len(tokens)
        i = first
        while i < len(messages):
            turn = self.assistant(messages[i]["content"])
            tokens, mask = tokens + turn, mask + [True] * len(turn)
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            if j < len(messages) or j > i + 1:  # between two assistant turns: at least the generation prompt
                inserted = self.insert(messages[i + 1:j])
                tokens, mask = tokens + inserted, mask + [False] * len(inserted)
            i = j
        return tokens, mask
