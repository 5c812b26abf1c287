"""The multi-turn rollout function with tools (recipe: `rollout.function: rlhf_mc.rollout.multi_turn:tool_loop`
and a `tools` section): the model answers, the tool calls in its turn are run, their results are appended, and it
answers again, until a turn makes no call or a limit ends the trajectory.

Token exactness: a trajectory holds the prompt's tokens, then per turn the tokens the engine sampled (loss mask 1,
with the engine's log-probs and weight version) and the tokens inserted after it (loss mask 0): the template's
closing text of the turn, the tool messages and the next generation prompt, tokenized against a fixed rendering
(data/chat.py). Nothing is re-rendered, so the trainer scores exactly the context the engine sampled from.

Turns are batched: each round sends every conversation still going to the engines at once (each to the engine that
served its prompt, whose prefix cache holds it), then runs all their tool calls at once in the sandbox.

Limits and how a trajectory ends (finish_reason): a turn with no tool call ends it with that turn's reason ("stop"
at the end-of-turn token; "length" when the token budget ran out mid-turn). Tool calls in the last allowed turn
(tools.max_turns), or tool results that would not fit in the token budget (data.max_response_length counts every
token after the prompt, inserted ones included), end it with "length" and count as a truncation. `Sample.text`,
what reward functions read, is the final answer: the last turn's text when it made no tool call, else empty (a
trajectory cut off while still calling tools has no answer). Reward functions that take a `messages` argument also
get the whole exchange (rewards/scoring.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rlhf_mc.data.chat import Conversation
from rlhf_mc.data.dataset import Prompt
from rlhf_mc.data.trajectory import NOT_SAMPLED, Sample
from rlhf_mc.rollout.base import RolloutSample, SamplingParams
from rlhf_mc.tools.executor import ToolExecutor, ToolResult
from rlhf_mc.tools.parsers import ToolCall

STATS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_outputs_cut", "truncated")


def tool_loop(generate: Callable[..., list[RolloutSample]], prompts: list[Prompt], sampling: SamplingParams,
              tokenizer, tools: ToolExecutor) -> list[Sample]:
    chat, limits = Conversation.of(tokenizer), tools.config
    budget = sampling.max_new_tokens
    outs = generate([p.ids for p in prompts], sampling, sessions=list(range(len(prompts))))
    samples = [_started(prompts[o.prompt_index].ids, o.prompt_index) for o in outs]
    prompt_lengths = [len(s.tokens) for s in samples]
    live = list(range(len(samples)))
    for turn in range(limits.max_turns):
        if turn:
            outs = generate([samples[i].tokens for i in live], dataclasses.replace(sampling, n=1),
                            sessions=[samples[i].prompt_index for i in live],
                            max_new_tokens=[budget - len(samples[i].tokens) + prompt_lengths[i] for i in live])
        calls: dict[int, list[ToolCall]] = {}
        for i, out in zip(live, outs):
            sample = samples[i]
            _append_turn(sample, out, tokenizer)
            ended = out.finish_reason != "stop" or not out.response_ids or out.response_ids[-1] != chat.end_of_turn
            made = [] if ended else tools.parse(sample.messages[-1]["content"])
            if not made:
                sample.finish_reason = out.finish_reason
                sample.text = tokenizer.decode(out.response_ids, skip_special_tokens=True)
            elif turn == limits.max_turns - 1:
                sample.finish_reason, sample.stats["truncated"] = "length", 1
            else:
                calls[i] = made
        results = _run(tools, calls)
        live = []
        for i, answers in results.items():
            sample = samples[i]
            messages = [{"role": "tool", "name": r.name, "content": _cut(r.content, limits.output_tokens, tokenizer,
                                                                           sample.stats)} for r in answers]
            sample.stats["tool_calls"] += len(answers)
            sample.stats["tool_errors"] += sum(r.status in ("error", "crashed") for r in answers)
            sample.stats["tool_timeouts"] += sum(r.status == "timeout" for r in answers)
            inserted = chat.insert(messages)
            if len(sample.tokens) - prompt_lengths[i] + len(inserted) >= budget:  # no room left to answer
                sample.finish_reason, sample.stats["truncated"] = "length", 1
                continue
            sample.messages += messages
            sample.tokens += inserted
            sample.loss_mask += [False] * len(inserted)
            sample.logprobs += [0.0] * len(inserted)
            sample.versions += [NOT_SAMPLED] * len(inserted)
            live.append(i)
        if not live:
            break
    return samples


def _started(prompt: list[int], prompt_index: int) -> Sample:
    """A trajectory holding its prompt: no token sampled yet."""
    n = len(prompt)
    return Sample(prompt_index, list(prompt), [False] * n, [0.0] * n, [NOT_SAMPLED] * n, "", "", messages=[],
                  stats=dict.fromkeys(STATS, 0))


def _append_turn(sample: Sample, out: RolloutSample, tokenizer) -> None:
    sample.tokens += out.response_ids
    sample.loss_mask += [True] * len(out.response_ids)
    sample.logprobs += out.logprobs
    sample.versions += out.versions
    sample.stats["turns"] += 1
    if out.routed_experts is not None:  # the whole conversation so far; the engine never ran its last token
        sample.routed_experts = out.routed_experts.new_full((len(sample.tokens), out.routed_experts.size(1)), -1)
        sample.routed_experts[:len(out.routed_experts)] = out.routed_experts
    ids = out.response_ids[:-1] if out.finish_reason == "stop" else out.response_ids  # the turn's closing token
    sample.messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=False)})


def _run(tools: ToolExecutor, calls: dict[int, list[ToolCall]]) -> dict[int, list[ToolResult]]:
    """Every conversation's calls at once; those over tools.max_calls_per_turn are answered, not run."""
    cap = tools.config.max_calls_per_turn
    flat = [call for made in calls.values() for call in made[:cap]]
    answers = iter(tools.run(flat))
    refused = ToolResult("", f"not run: at most {cap} tool calls per turn", "error")
    return {i: [next(answers) for _ in made[:cap]] + [dataclasses.replace(refused, name=c.name) for c in made[cap:]]
            for i, made in calls.items()}


def _cut(content: str, limit: int, tokenizer, stats: dict) -> str:
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return content
    stats["tool_outputs_cut"] += 1
    return tokenizer.decode(ids[:limit]) + f"\n[{len(ids) - limit} more tokens cut]"
