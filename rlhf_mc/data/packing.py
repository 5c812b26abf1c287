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
    """Packs 1-D token tensors; each is right-padded with `pad_id` to a multiple of `multiple`."""
    if not sequences:
        raise ValueError("pack: no sequences")
    parts, positions, cu = [], [], [0]
    for seq in sequences:
        padded_len = -(-len(seq) // multiple) * multiple
        parts.append(torch.cat([seq, seq.new_full((padded_len - len(seq),), pad_id)]))
        positions.append(torch.arange(padded_len, device=seq.device))
        cu.append(cu[-1] + padded_len)
    return Packed(tokens=torch.cat(parts).unsqueeze(0), position_ids=torch.cat(positions).unsqueeze(0),
                  cu_seqlens=cu, lengths=[len(s) for s in sequences])
