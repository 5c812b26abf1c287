"""Context-parallel layout and THD packing against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.data.packing import pack
from rlhf_mc.runtime.context_parallel import cp_index, cp_positions, split_for_cp


def test_cp_positions_are_megatrons_load_balanced_chunks():
    # 8 tokens, cp=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp = 4"):
        cp_positions(6, 2, 0)


def test_packed_split_applies_the_layout_per_sequence():
    assert cp_index([0, 4, 12], 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    x = torch.arange(12).unsqueeze(0)
    parts = [split_for_cp(x, 2, r, dim=1, cu_seqlens=[0, 4, 12]) for r in range(2)]
    assert parts[1].tolist() == [[1, 2, 6, 7, 8, 9]]
    assert sorted(torch.cat(parts, dim=1)[0].tolist()) == list(range(12))


def test_pack_pads_each_sequence_to_the_multiple():
    packed = pack([torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 5])], multiple=4, pad_id=0)
    assert packed.tokens.tolist() == [[5, 6, 7, 0, 1, 2, 3, 4, 5, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert packed.cu_seqlens == [0, 4, 12] and packed.lengths == [3, 5]
    assert [t.tolist() for t in packed.unpack(packed.tokens[0])] == [[5, 6, 7], [1, 2, 3, 4, 5]]
    params = packed.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 4, 12] and params.max_seqlen_q == 8
