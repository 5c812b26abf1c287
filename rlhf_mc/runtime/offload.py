"""Frees the device memory of a model's training state while another phase needs the device (colocated rollouts):
parameters, gradient buffers and optimizer state go to host memory and come back before the model is used again.

Each distinct storage is copied to host (pinned with CUDA) and resized to zero bytes; a reload resizes it back and
copies the bytes in. Gradient buffers are not copied: every train step zeroes them before use, so they are freed
and come back zeroed. The weights and the rest can move separately (the colocation order frees the optimizer state
before the weight sync and the weights after it). Tensors and views keep their identity: Megatron's parameters and
main_grad are views of DDP's contiguous buffers, the distributed optimizer's fp32 shards of fp32 models are views of
the parameters, and the optimizer, DDP's hooks and the weight sync hold references to all of them, so nothing needs
to be told. (Moving
tensors with `.to("cpu")`, as Megatron's optimizer.offload_to_cpu does, replaces them and breaks such views.)
"""

from __future__ import annotations

from typing import Iterable, Iterator, Literal

import torch

# (an emptied storage, its size, its bytes on the host - or None: discarded, zeroed on reload)
Offloaded = list[tuple[torch.UntypedStorage, int, torch.Tensor | None]]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def offload(tensors: Iterable[torch.Tensor], reuse: Offloaded = (), discard: Iterable[torch.Tensor] = (),
            keep: Iterable[torch.Tensor] = ()) -> Offloaded:
    """Empties the storages of `tensors` and of `discard`, keeping the bytes of the former in host memory.
    `discard`: storages whose content is not needed (gradient buffers, zeroed before the next step uses them).
    `keep`: storages that stay (parameters whose views the optimizer holds, while only its state goes).
    `reuse`: the previous offload of the same tensors, whose host buffers are filled again (pinning gigabytes
    every step costs seconds)."""
    saved: Offloaded = []
    seen: set[int] = {t.untyped_storage().data_ptr() for t in keep}
    spare = [host for _, _, host in reuse if host is not None]
    for tensor, copy in [*((t, True) for t in tensors), *((t, False) for t in discard)]:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        host = None
        if copy:
            i = sum(h is not None for _, _, h in saved)
            host = spare[i] if i < len(spare) and spare[i].numel() == storage.nbytes() else torch.empty(
                storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_bytes(storage), non_blocking=True)
        saved.append((storage, storage.nbytes(), host))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies are done before their sources are freed
    for storage, _, _ in saved:
        storage.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return saved


def reload(saved: Offloaded) -> None:
    for storage, nbytes, host in saved:
        storage.resize_(nbytes)
        if host is None:
            _bytes(storage).zero_()
        else:
            _bytes(storage).copy_(host, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weight_tensors(chunks: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    for chunk in chunks:
        yield from chunk.parameters()


def gradient_tensors(chunks: list[torch.nn.Module], optimizer=None) -> Iterator[torch.Tensor]:
    """DDP's main_grad buffers and the optimizer's main-parameter gradients (views of those buffers or copies)."""
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "main_grad", None) is not None:
                yield param.main_grad
    for param in _main_params(optimizer):
        if param.grad is not None:
            yield param.grad


def optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """A Megatron optimizer's (chained or not) main parameters and its state (Adam's moments)."""
    yield from _main_params(optimizer)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else ():
        for state in inner.optimizer.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value))


def _main_params(optimizer) -> Iterator[torch.Tensor]:
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else ():
        for group in inner.optimizer.param_groups:
            yield from group["params"]


Part = Literal["all", "weights", "optimizer"]


def offload_training_state(chunks: list[torch.nn.Module], optimizer, part: Part, reuse: Offloaded = ()) -> Offloaded:
    """"weights": the parameters; "optimizer": gradients (discarded) and optimizer state (main parameters that are
    not views of the weights, moments); "all": both. Reload with reload()."""
    weights = list(weight_tensors(chunks))
    if part == "weights":
        return offload(weights, reuse)
    state = list(optimizer_tensors(optimizer))
    grads = list(gradient_tensors(chunks, optimizer))
    if part == "optimizer":
        return offload(state, reuse, discard=grads, keep=weights)
    return offload([*weights, *state], reuse, discard=grads)
