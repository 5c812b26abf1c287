"""THD packing: variable-length sequences concatenated into one row, with cu_seqlens boundaries.

Each sequence is padded (on the right) to a multiple that the parallel layout requires: 2*cp for context parallelism
(its load-balanced split cuts every sequence into 2*cp chunks), times tp with sequence parallelism. Padding tokens
belong to their sequence's tail; attention is causal, so they never influence real tokens.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Packed:
    tokens: torch.Tensor  # [1, total] (padded lengths)
    position_ids: torch.Tensor  # [1, total], restarting at 0 for each sequence
    cu_seqlens: list[int]  # boundaries of the padded sequences, len = n + 1
    lengths: list[int]  # real (unpadded) length of each sequence

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=self.tokens.device)
        max_len = max(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len)

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence real parts of a packed tensor x [total, ...]."""
        return [x[start:start + n] for start, n in zip(self.cu_seqlens[:-1], self.lengths)]

    def unpack_padded(self) -> list[torch.Tensor]:
        """Per-sequence tokens including their padding."""
        return [self.tokens[0, a:b] for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])]


def pack(sequences: list[torch.Tensor], multiple: int = 1, pad_id: int = 0) -> Packed:
    """Packs 1-D token tensors; each is right-padded with `pad_id` to a multiple of `multiple`. Whole-pack tensor
    ops: a loop over sequences was 3 small ops each, ~4 ms a step's micro-batches at 256 sequences."""
    if not sequences:
        raise ValueError("pack: no sequences")
    lengths = [len(s) for s in sequences]
    padded = torch.tensor([-(-n // multiple) * multiple for n in lengths])
    cu = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    tokens = torch.cat(sequences)
    if int(cu[-1]) != len(tokens):  # each sequence's tokens at its start in the pack, the rest pad_id
        real = torch.tensor(lengths)
        moved = torch.repeat_interleave(cu[:-1] - (real.cumsum(0) - real), real)
        tokens = tokens.new_full((int(cu[-1]),), pad_id).index_put_((torch.arange(len(moved)) + moved,), tokens)
    positions = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], padded)
    return Packed(tokens=tokens.unsqueeze(0), position_ids=positions.to(tokens.device).unsqueeze(0),
                  cu_seqlens=cu.tolist(), lengths=lengths)


def next_tokens(packed: Packed) -> torch.Tensor:
    """[1, total]: at each position the sequence's next token (what position t predicts), 0 at its last real token
    and on its padding."""
    ends = torch.repeat_interleave(torch.tensor(packed.lengths) - 1, torch.tensor(packed.cu_seqlens).diff())
    return torch.where(packed.position_ids[0].cpu() < ends, packed.tokens[0].roll(-1).cpu(), 0).unsqueeze(0)
