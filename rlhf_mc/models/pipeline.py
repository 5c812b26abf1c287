"""Forward (and backward) of micro-batches through Megatron's pipeline schedule, for any TP/PP/VPP/CP layout.

A micro-batch is a dict with `tokens` [b, s] and `position_ids` [b, s] (already split for this CP rank), optionally
`labels` [b, s] (the model then returns per-token cross-entropy instead of logits) and `packed_seq_params`
(THD input: b == 1, boundaries of the packed sequences in cu_seqlens), `head_positions` (the positions whose
logits are wanted: the output is then [1, k, vocab / tp] for them, models/head.py) and, for a mixture-of-experts
model, the rollout engine's `routed_experts` (models/routing.py: replayed or compared, as `routing` says).
Everything else in the dict is for `loss_fn`.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlhf_mc.models import head
from rlhf_mc.models.routing import Routing


def run_pipeline(model: list[torch.nn.Module], microbatches: list[dict], loss_fn: Callable, forward_only: bool,
                 routing: Routing | None = None) -> list:
    """Runs every micro-batch; returns what `loss_fn` reported for each (on the last pipeline stage; [] elsewhere).

    `loss_fn(microbatch, output) -> (loss, report)`: output is the model's output for the micro-batch (logits
    [b, s, vocab/tp] in the model's dtype, or per-token fp32 loss [b, s] when labels are given). Megatron's schedule
    scales `loss` by cp_size / num_microbatches before backward; DDP then averages over the data-parallel x
    context-parallel group.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    lengths = sorted({mb["tokens"].shape for mb in microbatches})
    if len(lengths) > 1 and not model[0].config.variable_seq_lengths:
        raise ValueError(f"micro-batch shapes differ ({lengths[0]} ... {lengths[-1]}); with virtual pipeline "
                         "parallelism (vpp > 1) every micro-batch must have the same shape: pad them to one length")

    # bf16 chunks are Float16Modules (models/gpt.build_model), which by default hand out the logits upcast to fp32:
    # a full-vocabulary fp32 copy of the micro-batch's logits next to the bf16 ones (at 32k tokens x 152k vocab
    # 19 GB more, measured on an H200). The heads upcast chunk by chunk (ops/logprobs.py) or take [b, s, 1].
    half_output = {"fp32_output": False} if model[0].config.bf16 else {}

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        routed = mb.get("routed_experts") if routing is not None else None
        if routed is not None:
            routing.before_forward(chunk, routed)
        with head.at_positions(chunk, mb.get("head_positions")):
            output = chunk(mb["tokens"], mb["position_ids"], None, labels=mb.get("labels"),
                           packed_seq_params=mb.get("packed_seq_params"), **half_output)
        if routed is not None:
            routing.after_forward(chunk, routed)
        return output, lambda out: loss_fn(mb, out)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(microbatches) for _ in model],
        model=model,
        num_microbatches=len(microbatches),
        # the sequence's whole length: the interleaved schedule (vpp > 1, fixed shapes) divides it by cp itself to
        # size the activations it passes between stages, and the micro-batches hold this CP rank's share
        seq_length=lengths[-1][1] * ps.get_context_parallel_world_size(),
        micro_batch_size=lengths[-1][0],
        forward_only=forward_only,
    )
