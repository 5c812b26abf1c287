"""The rollout engine interface the trainer uses, independent of the serving engine behind it.

Log-prob semantics (what `RolloutSample.logprobs` holds, and what the trainer must recompute to compare):
log p(token) under softmax(logits / temperature) of the raw model logits, before top-k / top-p truncation; with
temperature 0 (greedy) under softmax(logits). This is SGLang's default. With top_p = 1 and top_k = -1 it is exactly
the distribution the token was sampled from.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "context_length", "abort"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # every response runs to max_new_tokens (the model's EOS and stop_token_ids go on)
    seed: int | None = None  # sample i of a prompt uses seed + i; needs an engine that honours seeds

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"sampling.n: must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p: must lie in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k: must be -1 or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class RolloutSample:
    prompt_index: int  # position of the prompt in the generate() call
    sample_index: int  # 0..n-1
    response_ids: list[int]
    logprobs: list[float]  # one per response token, see the module docstring
    finish_reason: FinishReason
    # per response token: the version of the weights that generated it (-1: the engine's launch weights); a
    # response generated across a weight update (a partial rollout) has the old version, then the new
    versions: list[int]
    engine: int = 0  # which engine served it
    # mixture-of-experts models (RolloutConfig.return_routed_experts): [prompt + response tokens - 1, layers * top-k]
    # int16, the experts each token was routed to in each layer, in the router's order; the last token was never
    # run through the model
    routed_experts: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """What the trainer calls. Weight versions are integers the trainer chooses (its step count)."""

    weight_version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, sessions: list[int] | None = None,
                 max_new_tokens: list[int] | None = None) -> list[RolloutSample]:
        """n samples per prompt, ordered by (prompt, sample). `sessions`: prompts with the same session go to the
        same engine (a conversation's turns, whose prefix that engine has cached); `max_new_tokens`: per prompt,
        instead of sampling.max_new_tokens."""

    def update_weights_from_tensors(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """Colocated: HF-named tensors handed to the engines on the same machine."""

    def update_weights_from_distributed(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int,
                                        num_buckets: int) -> None:
        """Disaggregated: the engines receive each bucket, flattened into one tensor, broadcast over the weight
        group (see the implementation for how the group is set up)."""

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Fallback: the engines reload an HF checkpoint directory."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> None: ...

    def release_memory(self, tags: Iterable[str]) -> None:
        """Colocated: free the engines' memory of `tags` (weights, KV cache) for training."""

    def resume_memory(self, tags: Iterable[str]) -> None: ...

    def healthy(self) -> bool: ...

    def shutdown(self) -> None: ...
