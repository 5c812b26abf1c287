"""The one batch type from rollout to update: trajectories packed flat (DESIGN.md, "One training step").

A trajectory is its token sequence: the prompt, the sampled response and, in multi-turn rollouts, the tokens
inserted between turns (tool results, user messages). `loss_mask` marks the tokens the policy sampled, the ones the
loss trains on; prompt and inserted tokens are 0, so nothing downstream needs to know where a "response" starts.
`versions` holds the weight version that sampled each token (NOT_SAMPLED elsewhere). Every per-token field is
aligned with the tokens: its value at token t is about token t (its log-prob given the tokens before it, the value
of the state before it, its advantage); a sequence's first token, which nothing predicts, holds 0.

A mixture-of-experts model's rollouts also carry `routed_experts` [T, layers * top-k]: the experts the engine routed
each token to (models/routing.py; -1 for tokens it never ran).

Flat tensors, not lists of rows: a data-parallel share or a mini-batch is one `select`, and it travels through Ray's
object store as a few tensors rather than thousands of small ones.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

NOT_SAMPLED = -1  # the version of tokens no policy sampled (prompt, inserted)


@dataclasses.dataclass
class Sample:
    """One trajectory as a rollout function returns it (rollout/functions.py); per-token lists span the tokens."""

    prompt_index: int  # which of the rollout's prompts it answers: its group
    tokens: list[int]  # the whole sequence: prompt, sampled and inserted tokens
    loss_mask: list[bool]  # sampled by the policy
    logprobs: list[float]  # the engine's log-prob of each sampled token, 0 elsewhere
    versions: list[int]  # the weight version that sampled each token, NOT_SAMPLED elsewhere
    finish_reason: str  # rollout/base.FinishReason
    text: str  # what the reward function reads: the response (multi-turn: the final answer), decoded
    routed_experts: torch.Tensor | None = None  # [len(tokens), layers * top-k] int16, -1: not run by the engine
    # multi-turn: the exchange after the prompt as chat messages (assistant turns, tool results), for rewards
    messages: list[dict] | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # per-trajectory counts, logged as means


@dataclasses.dataclass
class Trajectories:
    tokens: torch.Tensor  # [T] int64, the sequences one after another
    lengths: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [T] bool
    versions: torch.Tensor  # [T] int64
    scores: torch.Tensor  # [N] float32
    groups: torch.Tensor  # [N] int64: the samples of one prompt share a group
    fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # each [T] float32
    finish_reasons: list[str] = dataclasses.field(default_factory=list)  # per sample, rollout/base.FinishReason
    routed_experts: torch.Tensor | None = None  # [T, layers * top-k] int16 (mixture-of-experts rollouts)

    def __post_init__(self):
        total, n = int(self.lengths.sum()), len(self.lengths)
        sizes = {"tokens": len(self.tokens), "loss_mask": len(self.loss_mask), "versions": len(self.versions),
                 **{k: len(v) for k, v in self.fields.items()},
                 **({"routed_experts": len(self.routed_experts)} if self.routed_experts is not None else {})}
        wrong = {k: v for k, v in sizes.items() if v != total}
        per_sample = {"scores": len(self.scores), "groups": len(self.groups),
                      **({"finish_reasons": len(self.finish_reasons)} if self.finish_reasons else {})}
        wrong.update({k: v for k, v in per_sample.items() if v != n})
        if wrong:
            raise ValueError(f"Trajectories: {n} sequences of {total} tokens, but fields of sizes {wrong}")

    @staticmethod
    def from_rows(tokens: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]],
                  versions: Sequence[Sequence[int]] | None = None, scores: Sequence[float] | None = None,
                  groups: Sequence[int] | None = None, fields: dict[str, Sequence[torch.Tensor]] | None = None,
                  finish_reasons: Sequence[str] = ()) -> "Trajectories":
        """From per-sequence rows (fields' rows aligned with the tokens). Versions default to 0 on the loss-mask
        tokens; scores to 0; groups to one per sequence."""
        flat = torch.tensor([t for row in tokens for t in row], dtype=torch.long)
        mask = torch.tensor([bool(m) for row in loss_masks for m in row], dtype=torch.bool)
        n = len(tokens)
        return Trajectories(
            tokens=flat, lengths=torch.tensor([len(row) for row in tokens], dtype=torch.long), loss_mask=mask,
            versions=(torch.tensor([v for row in versions for v in row], dtype=torch.long) if versions is not None
                      else torch.where(mask, 0, NOT_SAMPLED)),
            scores=torch.tensor(list(scores) if scores is not None else [0.0] * n, dtype=torch.float32),
            groups=torch.tensor(list(groups) if groups is not None else range(n), dtype=torch.long),
            fields={k: _cat(rows) for k, rows in (fields or {}).items()}, finish_reasons=list(finish_reasons))

    @staticmethod
    def from_samples(samples: Sequence[Sample], scores: Sequence[float]) -> "Trajectories":
        """The batch of scored samples, grouped by prompt, with the engine's log-probs as "rollout_logprobs" (and
        its routing, when the samples have it)."""
        batch = Trajectories.from_rows([s.tokens for s in samples], [s.loss_mask for s in samples],
                                       [s.versions for s in samples], scores, [s.prompt_index for s in samples],
                                       {"rollout_logprobs": [torch.tensor(s.logprobs) for s in samples]},
                                       [s.finish_reason for s in samples])
        if samples and samples[0].routed_experts is not None:  # replace: the sizes are checked again
            batch = dataclasses.replace(batch, routed_experts=torch.cat([s.routed_experts for s in samples]))
        return batch

    @staticmethod
    def single_turn(sequences: Sequence[Sequence[int]], response_starts: Sequence[int],
                    response_fields: dict[str, Sequence[torch.Tensor]] | None = None, **kwargs) -> "Trajectories":
        """Prompt + response sequences, the loss on the tokens from `response_starts`; `response_fields` hold
        values for the response tokens only (placed at their positions, 0 on the prompt)."""
        for i, (seq, start) in enumerate(zip(sequences, response_starts)):
            if not 1 <= start < len(seq):
                raise ValueError(f"response start {start} of sequence {i} must lie in [1, {len(seq)})")
        masks = [[False] * start + [True] * (len(seq) - start) for seq, start in zip(sequences, response_starts)]
        fields = {k: [torch.cat([torch.zeros(start), torch.as_tensor(row, dtype=torch.float32)])
                      for start, row in zip(response_starts, rows)] for k, rows in (response_fields or {}).items()}
        return Trajectories.from_rows([list(map(int, s)) for s in sequences], masks, fields=fields, **kwargs)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def offsets(self) -> list[int]:
        return [0, *torch.cumsum(self.lengths, 0).tolist()]

    def rows(self, values: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per sequence, its part of a per-token tensor (default: the tokens)."""
        return list(torch.split(self.tokens if values is None else values, self.lengths.tolist()))

    def masked(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per sequence, a per-token tensor at its loss-mask tokens (for single-turn data: the response)."""
        return [v[m] for v, m in zip(self.rows(values), self.rows(self.loss_mask))]

    def sequence_ids(self) -> torch.Tensor:
        """[T]: the sequence each token belongs to."""
        return torch.repeat_interleave(torch.arange(len(self)), self.lengths)

    def sampled_tokens(self) -> torch.Tensor:
        """[N]: each sequence's loss-mask tokens (for single-turn data: its response length)."""
        return torch.zeros(len(self), dtype=torch.long).index_add_(0, self.sequence_ids(), self.loss_mask.long())

    def token_index(self, index: Sequence[int]) -> torch.Tensor:
        """The flat positions of the tokens of sequences `index`, in that order."""
        offsets = self.offsets
        if not len(index):
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in index])

    def select(self, index: Sequence[int]) -> "Trajectories":
        """The sequences at `index`, in that order."""
        index = list(index)
        tokens, samples = self.token_index(index), torch.tensor(index, dtype=torch.long)
        return Trajectories(self.tokens[tokens], self.lengths[samples], self.loss_mask[tokens], self.versions[tokens],
                            self.scores[samples], self.groups[samples], {k: v[tokens] for k, v in self.fields.items()},
                            [self.finish_reasons[i] for i in index] if self.finish_reasons else [],
                            self.routed_experts[tokens] if self.routed_experts is not None else None)

    def with_fields(self, **fields: torch.Tensor) -> "Trajectories":
        return dataclasses.replace(self, fields={**self.fields, **fields})

    def padded(self, values: torch.Tensor | None = None) -> torch.Tensor:
        """[N, longest] of a per-token tensor (default: the loss mask), 0 past each sequence's end."""
        rows = self.rows(self.loss_mask if values is None else values)
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    def unpadded(self, values: torch.Tensor) -> torch.Tensor:
        """The inverse of `padded`: [T] from [N, longest]."""
        return torch.cat([row[:n] for row, n in zip(values, self.lengths.tolist())])


def _cat(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.as_tensor(r, dtype=torch.float32) for r in rows]) if rows else torch.zeros(0)


def gather_shares(batch: Trajectories, shares: list[list[int]], answers: list[torch.Tensor]) -> torch.Tensor:
    """A per-token tensor of the whole batch from the tensors of its shares (sequences `shares[k]`, answer k)."""
    out = torch.zeros(len(batch.tokens), dtype=answers[0].dtype)
    for share, answer in zip(shares, answers):
        out[batch.token_index(share)] = answer
    return out
