"""Partitioning sequences: across data-parallel ranks (balanced tokens) and into micro-batches (token budget or
count). Every function returns lists of indices into the input, so results can be put back in the original order."""

from __future__ import annotations

import heapq


def balance_across_ranks(lengths: list[int], ranks: int) -> list[list[int]]:
    """Splits sequences into `ranks` groups of equal count with near-equal token sums (longest first, each to the
    lightest group that still has room). Needs len(lengths) divisible by ranks."""
    if len(lengths) % ranks:
        raise ValueError(f"{len(lengths)} sequences do not split evenly over {ranks} data-parallel ranks")
    per_rank = len(lengths) // ranks
    groups: list[list[int]] = [[] for _ in range(ranks)]
    heap = [(0, r) for r in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        full = []
        while True:
            tokens, r = heapq.heappop(heap)
            if len(groups[r]) < per_rank:
                break
            full.append((tokens, r))
        groups[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], r))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(g) for g in groups]


def micro_batches_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing into micro-batches of at most `max_tokens` tokens (padded lengths); each one's members
    longest first, so that sequences of similar length are packed next to each other (models/attention.py attends
    such runs together)."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"micro_batch_tokens: sequence {i} has {n} tokens, more than the budget {max_tokens}")
    bins: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, (used, members) in enumerate(bins):
            if used + lengths[i] <= max_tokens:
                bins[b] = (used + lengths[i], members + [i])
                break
        else:
            bins.append((lengths[i], [i]))
    return [members for _, members in bins]
