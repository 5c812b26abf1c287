"""Batch container operations and the partitioning of sequences, against hand-computed results."""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.data.batch import Batch, inverse_permutation
from rlhf_mc.data.microbatch import balance_across_ranks, micro_batches_by_count, micro_batches_by_tokens


def _batch(n=4):
    return Batch({"x": torch.arange(n * 2).reshape(n, 2)}, {"id": [f"s{i}" for i in range(n)]})


def test_select_split_concat_union_and_inverse_reorder():
    b = _batch()
    order = [2, 0, 3, 1]
    shuffled = b.select(order)
    assert shuffled.meta["id"] == ["s2", "s0", "s3", "s1"] and shuffled.tensors["x"][0].tolist() == [4, 5]
    back = shuffled.select(inverse_permutation(order))
    assert torch.equal(back.tensors["x"], b.tensors["x"]) and back.meta == b.meta
    first, second = b.split([1, 3])
    assert len(first) == 1 and second.meta["id"] == ["s1", "s2", "s3"]
    joined = Batch.concat(b.chunk(2))
    assert torch.equal(joined.tensors["x"], b.tensors["x"]) and joined.meta == b.meta
    merged = b.union(Batch({"y": torch.ones(4)}, {"id": b.meta["id"]}))
    assert set(merged.tensors) == {"x", "y"}


@pytest.mark.parametrize("call, message", [
    (lambda b: b.split([1, 1]), "sizes \\[1, 1\\] do not add up to 4"),
    (lambda b: b.chunk(3), "4 samples do not split into 3 equal parts"),
    (lambda b: b.union(Batch({"x": torch.zeros(4, 2, dtype=torch.long)})), "field 'x' differs"),
    (lambda b: Batch({"x": torch.zeros(3)}, {"id": [1, 2]}), "fields differ in length"),
])
def test_batch_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(_batch())


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
    assert micro_batches_by_tokens([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]  # first-fit decreasing: 5+2, 4+3
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than the budget 7"):
        micro_batches_by_tokens([5, 9], 7)
    assert micro_batches_by_count(5, 2) == [[0, 1], [2, 3], [4]]
