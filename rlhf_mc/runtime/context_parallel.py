"""Megatron's load-balanced context-parallel layout, in one place for the data path and the attention.

A sequence of length L (a multiple of 2*cp) is cut into 2*cp equal chunks; CP rank r holds chunks r and 2*cp-1-r,
in that order, so every rank gets the same amount of causal-attention work. Packed (THD) input applies the same
layout to each sequence of the pack separately.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions (within one sequence of length `seq_len`) of the tokens that `cp_rank` holds, in local order."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*cp = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    steps = torch.arange(chunk, device=device)
    return torch.cat([cp_rank * chunk + steps, (2 * cp_size - 1 - cp_rank) * chunk + steps])


def cp_packed_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """cp_positions of every sequence of a pack, concatenated in pack order (what cp_index holds, less each
    sequence's start), without a loop over the sequences: per layer in the rotary embedding (models/rope.py).
    `cu_seqlens`: a tensor of the boundaries before the CP split, on the tokens' device."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    local = lengths // cp_size
    starts = torch.cumsum(local, 0) - local
    index = torch.arange(int(local.sum()), device=cu_seqlens.device)
    within = index - torch.repeat_interleave(starts, local)  # position in this rank's part of the sequence
    if cp_size == 1:
        return within
    chunk = torch.repeat_interleave(local // 2, local)
    full = torch.repeat_interleave(lengths, local)
    # first chunk: cp_rank x chunk + i; second: (full - (cp_rank + 1) x chunk) + (i - chunk)
    return torch.where(within < chunk, cp_rank * chunk + within, full - (cp_rank + 2) * chunk + within)


def cp_index(cu_seqlens: list[int], cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Indices (into a row of packed sequences with boundaries `cu_seqlens`) of the tokens `cp_rank` holds, in local
    order: each sequence split on its own, the local parts concatenated in pack order. One unpacked sequence of
    length s is cu_seqlens=[0, s]."""
    return torch.cat([start + cp_positions(end - start, cp_size, cp_rank, device)
                      for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])])


def split_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1,
                 cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """The part of `x` that `cp_rank` holds along `dim` (the sequence dim); see cp_index."""
    if cp_size == 1:
        return x
    bounds = cu_seqlens if cu_seqlens is not None else [0, x.size(dim)]
    return x.index_select(dim, cp_index(bounds, cp_size, cp_rank, x.device))


def gather_from_cp(x: torch.Tensor, cp_group, dim: int = 1, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """Inverse of split_for_cp over a CP group: every rank gets the whole sequence dim back (no autograd)."""
    cp_size = dist.get_world_size(cp_group)
    if cp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(parts, x, group=cp_group)
    shape = list(x.shape)
    shape[dim] *= cp_size
    full = x.new_empty(shape)
    bounds = cu_seqlens if cu_seqlens is not None else [0, shape[dim]]
    for rank, part in enumerate(parts):
        full.index_copy_(dim, cp_index(bounds, cp_size, rank, x.device), part)
    return full
