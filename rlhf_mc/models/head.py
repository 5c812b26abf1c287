"""The vocabulary projection at chosen positions only: a policy's losses and log-probs need the logits of the
positions that predict response tokens, not of the prompt's (nor of tool outputs or padding).

The projection of a position is hidden x vocab multiply-adds, and its softmax (forward and backward) passes over
a vocabulary-wide row: at a 49k vocabulary and 576 hidden (SmolLM2-135M) the head is a fifth of the step's matmul
work and most of its memory traffic, and at a 152k vocabulary the fp32 logits of the prompts are the largest
buffer of a long-prompt step. Selecting the positions before the output layer skips that work for every position
outside the loss mask; the model's logits then come back [b, k, vocab / tp] for the k positions asked.

With sequence parallelism each TP rank holds a slice of the positions: the hidden states are gathered first (their
gradient reduce-scattered back), the chosen rows are taken and split again over the ranks, so the output layer's
own gather puts them back together (k padded to a multiple of tp; the padding rows are position 0's and are
dropped by the caller, which reads the first k rows).
"""

from __future__ import annotations

import contextlib

import torch


def select_positions(output_layer: torch.nn.Module) -> None:
    """Makes `output_layer` (Megatron's ColumnParallelLinear head of a GPTModel) project only the positions
    `at_positions` names, when it names any."""
    output_layer.head_positions = None
    output_layer.register_forward_pre_hook(_take_positions, with_kwargs=True)


def _take_positions(layer, args, kwargs):
    positions = layer.head_positions
    if positions is None:
        return None
    hidden, rest = args[0], args[1:]  # [s (/ tp), b, h]
    if not layer.sequence_parallel:
        return (hidden[positions], *rest), kwargs
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pad = (-len(positions)) % tp if len(positions) else tp  # every rank a share, none empty
    padded = torch.cat([positions, positions.new_zeros(pad)])
    rows = gather_from_sequence_parallel_region(hidden)[padded]
    return (rows.chunk(tp)[rank], *rest), kwargs


def _output_layer(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer of a model chunk under its wrappers (DDP, Float16Module); None where it has none (an
    earlier pipeline stage) or the head does not select (a value head)."""
    while not hasattr(chunk, "output_layer") and hasattr(chunk, "module"):
        chunk = chunk.module
    layer = getattr(chunk, "output_layer", None)
    return layer if hasattr(layer, "head_positions") else None


@contextlib.contextmanager
def at_positions(chunk: torch.nn.Module, positions: torch.Tensor | None):
    """Within the block, `chunk`'s forward projects the 1-D `positions` of its (b = 1, packed) sequence only."""
    layer = _output_layer(chunk) if positions is not None else None
    if layer is None:
        yield
        return
    layer.head_positions = positions
    try:
        yield
    finally:
        layer.head_positions = None
