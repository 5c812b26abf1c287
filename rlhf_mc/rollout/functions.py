"""The default rollout function and group filter; a recipe names its own by import path (rollout.function,
algorithm.group_filter), with the same signatures.

A rollout function `fn(generate, prompts, sampling, tokenizer, **rollout.function_kwargs) -> list[Sample]` gets
the engines as `generate(prompt_ids, sampling) -> list[RolloutSample]` (n samples per prompt, rollout/base.py) and
returns one data.trajectory.Sample per trajectory, in any number per prompt; a multi-turn function calls
`generate` once per turn with the conversations still going. A group filter `keep(scores) -> bool` decides, with
dynamic sampling on, whether a prompt's group of samples is trained on.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlhf_mc.data.dataset import Prompt
from rlhf_mc.data.trajectory import NOT_SAMPLED, Sample
from rlhf_mc.rollout.base import RolloutSample, SamplingParams


def single_turn(generate: Callable[[list[list[int]], SamplingParams], list[RolloutSample]], prompts: list[Prompt],
                sampling: SamplingParams, tokenizer) -> list[Sample]:
    """One response per sample: the prompt, then the sampled tokens (trained on)."""
    out = []
    for s in generate([p.ids for p in prompts], sampling):
        prompt, n = prompts[s.prompt_index].ids, len(s.response_ids)
        routed = None
        if s.routed_experts is not None:  # the engine never ran the last token
            routed = torch.cat([s.routed_experts, s.routed_experts.new_full((1, s.routed_experts.size(1)), -1)])
        out.append(Sample(s.prompt_index, prompt + s.response_ids, [False] * len(prompt) + [True] * n,
                          [0.0] * len(prompt) + list(s.logprobs), [NOT_SAMPLED] * len(prompt) + s.versions,
                          s.finish_reason, tokenizer.decode(s.response_ids, skip_special_tokens=True), routed))
    return out


def scores_differ(scores: list[float]) -> bool:
    """DAPO's dynamic sampling: a group whose scores are all equal has zero advantage everywhere; drop it."""
    return len(set(scores)) > 1
