"""Frees the device memory of a model's training state while another phase needs the device (colocated rollouts):
parameters, gradient buffers and optimizer state go to host memory and come back before the model is used again.

Each distinct storage is copied to host (pinned with CUDA) and resized to zero bytes; a reload resizes it back and
copies the bytes in. Tensors and views keep their identity: Megatron's parameters and main_grad are views of DDP's
contiguous buffers, the distributed optimizer's fp32 shards of fp32 models are views of the parameters, and the
optimizer, DDP's hooks and the weight sync hold references to all of them, so nothing needs to be told. (Moving
tensors with `.to("cpu")`, as Megatron's optimizer.offload_to_cpu does, replaces them and breaks such views.)
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

Offloaded = list[tuple[torch.UntypedStorage, torch.Tensor]]  # (the emptied storage, its bytes on the host)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def offload(tensors: Iterable[torch.Tensor], reuse: Offloaded = ()) -> Offloaded:
    """`reuse`: the previous offload of the same tensors, whose host buffers are filled again (pinning gigabytes
    every step costs seconds)."""
    saved: Offloaded = []
    seen: set[int] = set()
    spare = [host for _, host in reuse]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        i = len(saved)
        host = spare[i] if i < len(spare) and spare[i].numel() == storage.nbytes() else torch.empty(
            storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        host.copy_(_bytes(storage), non_blocking=True)
        saved.append((storage, host))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies are done before their sources are freed
    for storage, _ in saved:
        storage.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return saved


def reload(saved: Offloaded) -> None:
    for storage, host in saved:
        storage.resize_(host.numel())
        _bytes(storage).copy_(host, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def training_tensors(chunks: list[torch.nn.Module], optimizer=None) -> Iterator[torch.Tensor]:
    """Parameters and their main_grad buffers; with a Megatron optimizer (chained or not) its main parameters, their
    gradients and its state (Adam's moments)."""
    for chunk in chunks:
        for param in chunk.parameters():
            yield param
            if getattr(param, "main_grad", None) is not None:
                yield param.main_grad
    if optimizer is None:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                yield param
                if param.grad is not None:
                    yield param.grad
        for state in inner.optimizer.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value))
