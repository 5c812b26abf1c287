"""The trajectory batch (data/trajectory.py) and the partitioning of sequences, against hand-computed results."""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.data.microbatch import balance_across_ranks, micro_batches_by_tokens
from rlhf_mc.data.trajectory import NOT_SAMPLED, Sample, Trajectories, gather_shares


def _batch() -> Trajectories:
    # prompt [1, 2] then a response of 2 tokens; prompt [3] then 3 tokens, a tool token (9) inserted after the first
    return Trajectories.from_rows([[1, 2, 5, 6], [3, 7, 9, 8]], [[0, 0, 1, 1], [0, 1, 0, 1]],
                                  [[-1, -1, 4, 4], [-1, 3, -1, 4]], scores=[1.0, 0.0], groups=[0, 0],
                                  fields={"adv": [torch.tensor([0.0, 0, 1, 2]), torch.tensor([0.0, 3, 0, 4])]},
                                  finish_reasons=["stop", "length"])


def test_rows_masks_select_and_padding():
    b = _batch()
    assert len(b) == 2 and b.offsets == [0, 4, 8]
    assert [r.tolist() for r in b.rows()] == [[1, 2, 5, 6], [3, 7, 9, 8]]
    assert [r.tolist() for r in b.masked(b.tokens)] == [[5, 6], [7, 8]]  # the tool token is not trained on
    assert [r.tolist() for r in b.masked(b.versions)] == [[4, 4], [3, 4]]
    assert b.sequence_ids().tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and b.sampled_tokens().tolist() == [2, 2]
    swapped = b.select([1, 0])
    assert swapped.tokens.tolist() == [3, 7, 9, 8, 1, 2, 5, 6] and swapped.finish_reasons == ["length", "stop"]
    assert swapped.fields["adv"].tolist() == [0, 3, 0, 4, 0, 0, 1, 2] and swapped.scores.tolist() == [0.0, 1.0]
    one = b.select([1])
    assert one.padded().tolist() == [[False, True, False, True]]
    short = Trajectories.from_rows([[1, 2, 3], [4, 5]], [[0, 1, 1], [0, 1]])
    padded = short.padded(short.tokens)
    assert padded.tolist() == [[1, 2, 3], [4, 5, 0]] and short.unpadded(padded).tolist() == [1, 2, 3, 4, 5]
    assert short.versions.tolist() == [NOT_SAMPLED, 0, 0, NOT_SAMPLED, 0] and short.groups.tolist() == [0, 1]


def test_single_turn_places_response_fields_and_shares_gather_back():
    b = Trajectories.single_turn([[1, 2, 3], [4, 5, 6, 7]], [1, 3],
                                 {"x": [torch.tensor([1.0, 2]), torch.tensor([3.0])]})
    assert b.loss_mask.tolist() == [False, True, True, False, False, False, True]
    assert b.fields["x"].tolist() == [0, 1, 2, 0, 0, 0, 3]
    shares = [[1], [0]]
    answers = [b.select(s).fields["x"] * 10 for s in shares]
    assert gather_shares(b, shares, answers).tolist() == [0, 10, 20, 0, 0, 0, 30]
    samples = [Sample(0, [1, 2, 3], [False, True, True], [0.0, -0.5, -0.25], [-1, 2, 2], "stop", "x")]
    from_samples = Trajectories.from_samples(samples, [0.5])
    assert from_samples.fields["rollout_logprobs"].tolist() == [0.0, -0.5, -0.25]
    assert from_samples.scores.tolist() == [0.5]


@pytest.mark.parametrize("call, message", [
    (lambda: Trajectories.single_turn([[1, 2]], [2]), "response start 2 of sequence 0 must lie in \\[1, 2\\)"),
    (lambda: Trajectories.from_rows([[1, 2]], [[0, 1, 1]]),
     "2 tokens, but fields of sizes {'loss_mask': 3, 'versions': 3}"),
    (lambda: Trajectories.from_rows([[1, 2]], [[0, 1]], scores=[1.0, 2.0]), "sizes {'scores': 2}"),
])
def test_trajectory_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_balance_across_ranks():
    groups = balance_across_ranks([10, 1, 9, 2, 8, 3], 2)
    assert sorted(len(g) for g in groups) == [3, 3]
    sums = sorted(sum([10, 1, 9, 2, 8, 3][i] for i in g) for g in groups)
    # Longest first to the lightest group with room: 10|9, 8->9, 3->10, 2->13, 1->17 (the first group is full)
    assert sums == [15, 18]
    assert sorted(i for g in groups for i in g) == list(range(6))
    with pytest.raises(ValueError, match="5 sequences do not split evenly over 2 data-parallel ranks"):
        balance_across_ranks([1] * 5, 2)


def test_micro_batches_by_tokens():
    # first-fit decreasing: 5+2, 4+3; each micro-batch longest first
    assert micro_batches_by_tokens([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than the budget 7"):
        micro_batches_by_tokens([5, 9], 7)
