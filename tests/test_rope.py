"""The one-pass packed rotary embedding (models/rope.py) against Megatron-Core's own per-sequence THD rotation: the
same outputs and input gradients to the bit, with and without context parallelism, interleaved or not, partial
rotary, in fp32 and in bf16; within two ulps where a large pack runs the rotation compiled (models/cpu_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from rlhf_mc.models import rope


class _Rank:
    """What the rotation reads of a CP process group: its size and this rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp_size, cp_rank", [(1, 0), (2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("rotary_interleaved", [False, True])
@pytest.mark.parametrize("rotary_dims", [16, 8])  # all of the head's dims, or half of them (rotary_percent 0.5)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rotary_matches_megatron(cp_size, cp_rank, rotary_interleaved, rotary_dims, dtype):
    g = torch.Generator().manual_seed(cp_size * 10 + cp_rank)
    multiple = 2 * cp_size if cp_size > 1 else 1
    lengths = [multiple * int(n) for n in torch.randint(1, 9, (7,), generator=g)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    local = sum(lengths) // cp_size
    freqs = torch.randn(max(lengths) + 5, 1, 1, rotary_dims, generator=g)
    t = torch.randn(local, 3, 16, generator=g).to(dtype)
    outputs, grads = [], []
    for fn in (rope._megatron_thd, rope._apply_rotary_pos_emb_thd):
        x = t.clone().requires_grad_()
        out = fn(x, cu, freqs, rotary_interleaved=rotary_interleaved, mscale=1.3, cp_group=_Rank(cp_size, cp_rank))
        out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin())
        outputs.append(out.detach())
        grads.append(x.grad)
    assert torch.equal(outputs[1], outputs[0]) and torch.equal(grads[1], grads[0])  # the same ops, to the bit


def test_packed_positions_by_hand():
    from rlhf_mc.runtime.context_parallel import cp_packed_positions, cp_positions

    cu = torch.tensor([0, 3, 5])
    assert cp_packed_positions(cu, 1, 0).tolist() == [0, 1, 2, 0, 1]
    # CP 2: sequences of 8 and 4 in chunks of 2 and 1; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    cu = torch.tensor([0, 8, 12])
    assert cp_packed_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 0, 3]
    assert cp_packed_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 1, 2]
    for rank in range(2):  # the per-sequence layout of the data path
        assert cp_packed_positions(cu, 2, rank).tolist() == [*cp_positions(8, 2, rank).tolist(),
                                                             *cp_positions(4, 2, rank).tolist()]


def test_megatron_calls_the_packed_rotation():
    from megatron.core.models.common.embeddings import rope_utils

    from rlhf_mc.models.rope import use_packed_rotary

    use_packed_rotary()
    assert rope_utils._apply_rotary_pos_emb_thd is rope._apply_rotary_pos_emb_thd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rotation_of_a_large_pack_within_ulps(dtype):
    # 4096 tokens x 4 heads x 32 dims = 2^19 >= COMPILE_FROM elements: on CPU the rotation runs as one compiled kernel
    # (models/cpu_kernels.py), which rounds once where Megatron's ops round each product
    from rlhf_mc.models.cpu_kernels import COMPILE_FROM

    g = torch.Generator().manual_seed(7)
    cu = torch.arange(0, 4097, 512, dtype=torch.int32)
    freqs = torch.randn(512 + 5, 1, 1, 32, generator=g)
    t = torch.randn(4096, 4, 32, generator=g).to(dtype)
    assert t.numel() >= COMPILE_FROM
    results = []
    for fn in (rope._megatron_thd, rope._apply_rotary_pos_emb_thd):
        x = t.clone().requires_grad_()
        out = fn(x, cu, freqs, rotary_interleaved=False, mscale=1.0, cp_group=_Rank(1, 0))
        out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin())
        results.append((out.detach(), x.grad))
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -7)
    for ours, megatron in zip(results[1], results[0]):
        assert (ours - megatron).abs().max() <= 2 * ulp * megatron.abs().max()
