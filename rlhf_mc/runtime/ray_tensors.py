"""How tensors cross Ray between the driver and the ranks: as their raw bytes in a NumPy array, which Ray's pickle-5
path carries out of band, not through torch's own pickling.

torch pickles a tensor's storage as a torch.save of it into a bytes object, to be read back by
`torch.storage._load_from_bytes`, and names that loader by its module and attribute. megatron-core replaces the
attribute when it is imported (its safe_globals loader), so every tensor a rank returned named a megatron-core
module, and the driver, which has no use for megatron-core, imported all of it (3.1 s on 2 cores) to read the first
log-probs of every run, while the ranks waited. Each process that sends tensors registers this (the driver once
Ray is up, every rank at its start); the receiving side needs only torch and NumPy."""

from __future__ import annotations

import numpy as np
import torch


def register() -> None:
    """Tensors this process sends through Ray from now on go as their bytes (the process must be connected)."""
    import ray.util

    ray.util.register_serializer(torch.Tensor, serializer=_to_bytes, deserializer=_from_bytes)


def _to_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...], str]:
    """Dense tensors only: the ranks and the driver exchange no other kind."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), \
        str(tensor.device)


def _from_bytes(parts: tuple[np.ndarray, str, tuple[int, ...], str]) -> torch.Tensor:
    """A writable copy: the array Ray hands over may be read-only shared memory of its object store."""
    data, dtype, shape, device = parts
    flat = torch.empty(data.size, dtype=torch.uint8)
    flat.numpy()[:] = data
    tensor = flat.view(getattr(torch, dtype)).reshape(shape)
    return tensor if device == "cpu" else tensor.to(device)
