"""The container for one step's samples: tensors with a leading sample dimension plus per-sample metadata."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch


@dataclasses.dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # each [N, ...]
    meta: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # each of length N (ragged data too)

    def __post_init__(self):
        sizes = {k: len(v) for k, v in [*self.tensors.items(), *self.meta.items()]}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch: fields differ in length: {sizes}")

    def __len__(self) -> int:
        for values in [*self.tensors.values(), *self.meta.values()]:
            return len(values)
        return 0

    def select(self, index: Sequence[int] | torch.Tensor) -> "Batch":
        """The samples at `index`, in that order (subset or reorder)."""
        index = torch.as_tensor(index, dtype=torch.long)
        positions = index.tolist()
        return Batch({k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()},
                     {k: [v[i] for i in positions] for k, v in self.meta.items()})

    def split(self, sizes: Sequence[int]) -> list["Batch"]:
        if sum(sizes) != len(self):
            raise ValueError(f"Batch.split: sizes {list(sizes)} do not add up to {len(self)}")
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        return [self.select(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def chunk(self, parts: int) -> list["Batch"]:
        if len(self) % parts:
            raise ValueError(f"Batch.chunk: {len(self)} samples do not split into {parts} equal parts")
        return self.split([len(self) // parts] * parts)

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        keys = [(set(b.tensors), set(b.meta)) for b in batches]
        if any(k != keys[0] for k in keys):
            raise ValueError("Batch.concat: batches have different fields")
        first = batches[0]
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
                     {k: [x for b in batches for x in b.meta[k]] for k in first.meta})

    def union(self, other: "Batch") -> "Batch":
        """Fields of both (same samples, same order); a field in both must be equal."""
        if len(self) != len(other):
            raise ValueError(f"Batch.union: {len(self)} vs {len(other)} samples")
        for k in set(self.tensors) & set(other.tensors):
            if not torch.equal(self.tensors[k], other.tensors[k]):
                raise ValueError(f"Batch.union: field {k!r} differs")
        for k in set(self.meta) & set(other.meta):
            if self.meta[k] != other.meta[k]:
                raise ValueError(f"Batch.union: field {k!r} differs")
        return Batch({**self.tensors, **other.tensors}, {**self.meta, **other.meta})


def inverse_permutation(order: Sequence[int]) -> list[int]:
    """`inverse` with batch.select(order).select(inverse) == batch."""
    inverse = [0] * len(order)
    for position, i in enumerate(order):
        inverse[i] = position
    return inverse
