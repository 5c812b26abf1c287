"""Forward passes of a model on this rank: per-token log-probs (and entropy), or a critic's values, of a batch of
trajectories, packed (THD), micro-batched by a token budget, through Megatron's pipeline schedule.

The caller gives each data-parallel rank its share of the batch (data/microbatch.balance_across_ranks); results
come back on every rank of the model-parallel group, aligned with the share's tokens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from rlhf_mc.data.microbatch import micro_batches_by_tokens
from rlhf_mc.data.packing import next_tokens, pack
from rlhf_mc.data.trajectory import Trajectories
from rlhf_mc.bridge.weights import weights as _weights
from rlhf_mc.models.routing import Routing


def pad_multiple(config) -> int:
    """What each packed sequence's length must be a multiple of, for a model's TransformerConfig: 2*cp with context
    parallelism (its load-balanced split cuts a sequence into 2*cp chunks), times tp with sequence parallelism (the
    sequence is split over the TP ranks)."""
    cp = config.context_parallel_size
    multiple = 2 * cp if cp > 1 else 1
    return multiple * config.tensor_model_parallel_size if config.sequence_parallel else multiple


def build_microbatches(sequences: list[torch.Tensor], micro_batch_tokens: int, cp: int, cp_rank: int,
                       interleaved_pp: int, device, multiple: int = 1, routed: list[torch.Tensor] | None = None
                       ) -> tuple[list[dict], list[list[int]]]:
    """Packed micro-batches (this CP rank's part) and the sequence indices in each. For the interleaved (virtual)
    pipeline schedule over `interleaved_pp` stages (0: not interleaved), every pack is padded to the longest one by
    a trailing dummy sequence, and packs of padding only are added until their number is a multiple of the stages
    (both the schedule's requirements). `routed`: per sequence, the engine's routing of its tokens
    (models/routing.py), packed alongside as "routed_experts" (-1 on padding)."""
    from rlhf_mc.runtime.context_parallel import split_for_cp

    padded = [-(-len(s) // multiple) * multiple for s in sequences]
    groups = micro_batches_by_tokens(padded, micro_batch_tokens)
    packs = [pack([sequences[i] for i in group], multiple) for group in groups]
    longest = max(p.tokens.size(1) for p in packs)
    if interleaved_pp:
        filler = torch.zeros(longest, dtype=sequences[0].dtype)
        while len(packs) % interleaved_pp:
            packs.append(pack([filler], multiple))
            groups.append([])
    microbatches = []
    for packed in packs:
        if interleaved_pp and packed.tokens.size(1) < longest:
            filler = torch.zeros(longest - packed.tokens.size(1), dtype=packed.tokens.dtype)
            packed = pack([*packed.unpack_padded(), filler], multiple)
        cu = packed.cu_seqlens
        microbatches.append({
            "tokens": split_for_cp(packed.tokens, cp, cp_rank, 1, cu).to(device),
            "position_ids": split_for_cp(packed.position_ids, cp, cp_rank, 1, cu).to(device),
            "targets": split_for_cp(next_tokens(packed), cp, cp_rank, 1, cu).to(device),
            "packed_seq_params": _to(packed.packed_seq_params(), device),
            "packed": packed,
        })
    if routed is not None:
        for mb, group in zip(microbatches, groups):
            cu = mb["packed"].cu_seqlens
            rows = torch.full((cu[-1], routed[0].size(1)), -1, dtype=routed[0].dtype)
            for i, start in zip(group, cu):
                rows[start:start + len(routed[i])] = routed[i]
            mb["routed_experts"] = split_for_cp(rows, cp, cp_rank, 0, cu).to(device)
    return microbatches, groups


def align_to_predictions(batch: Trajectories, flat: dict[str, torch.Tensor], microbatches: list[dict],
                         groups: list[list[int]]) -> None:
    """Puts on each micro-batch (of build_microbatches, with its sequence `groups`) every per-token field of
    `flat` (flat over the batch's tokens) aligned to the positions whose logits predict the tokens: packed position
    t carries token t + 1's value, 0 where no token follows; plus "segment", the packed-sequence id of each
    position, and "head_positions", the positions that predict a loss-mask token (the only logits a policy's
    losses and log-probs need: models/head.py). This CP rank's part, on the device."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.runtime import device
    from rlhf_mc.runtime.context_parallel import split_for_cp

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    starts = torch.tensor(batch.offsets[:-1])
    for mb, group in zip(microbatches, groups):
        cu_seqlens = mb["packed"].cu_seqlens
        cu = torch.tensor(cu_seqlens)
        spans = cu[1:] - cu[:-1]  # padded sequences (the interleaved schedule's fillers too)
        aligned = {"segment": torch.repeat_interleave(torch.arange(len(spans)), spans).float()}
        # packed position cu[j] + t carries batch token starts[i] + t + 1 of sequence i = group[j], t < length - 1
        members = torch.tensor(group, dtype=torch.long)
        carried = batch.lengths[members] - 1
        t = torch.arange(int(carried.sum())) - torch.repeat_interleave(torch.cumsum(carried, 0) - carried, carried)
        to = torch.repeat_interleave(cu[:len(group)], carried) + t
        source = torch.repeat_interleave(starts[members] + 1, carried) + t
        for k, values in {**flat, "predicted": batch.loss_mask.float()}.items():
            aligned[k] = torch.zeros(int(cu[-1]))
            aligned[k][to] = values[source]
        for k, row in aligned.items():
            mb[k] = split_for_cp(row.unsqueeze(0), cp, cp_rank, 1, cu_seqlens).to(device())
        mb["head_positions"] = (mb.pop("predicted")[0] > 0).nonzero().squeeze(-1)


def head_logprobs(mb: dict, logits: torch.Tensor, tp_group, temperature: float = 1.0, with_entropy: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy or None) at every position of micro-batch `mb`, [s], from the model's `logits` of
    its "head_positions" ([1, >= k, vocab / tp], models/head.py); 0 at the other positions."""
    from rlhf_mc.ops.logprobs import vocab_parallel_logprobs

    positions = mb["head_positions"]
    targets = mb["targets"][0]
    logprobs, entropy = vocab_parallel_logprobs(logits[0, :len(positions)], targets[positions], tp_group,
                                                temperature, with_entropy)

    def everywhere(values):
        return torch.zeros(targets.shape, dtype=values.dtype, device=values.device).index_put((positions,), values)

    return everywhere(logprobs), everywhere(entropy) if with_entropy else None


def _to(params, device):
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = getattr(params, name, None)
        if value is not None:
            setattr(params, name, value.to(device))
    return params


@torch.no_grad()
def forward_per_token(chunks: list[torch.nn.Module], batch: Trajectories, head, micro_batch_tokens: int,
                      replay_routing: bool = False, at_loss_tokens: bool = False) -> dict[str, torch.Tensor]:
    """Runs the model over packed micro-batches; `head(mb, output) -> {name: [local tokens]}` turns the model's
    output into per-token values (at position t: the value for token t + 1). Returns each value as a per-token
    tensor of the batch (data/trajectory.py's alignment: 0 at each sequence's first token), on every rank.
    `replay_routing`: the routers take the batch's routed_experts (models/routing.py). `at_loss_tokens`: the model
    projects only the positions predicting loss-mask tokens (their "head_positions"; models/head.py), and `head`
    gives 0 elsewhere."""
    from megatron.core import parallel_state as ps

    from rlhf_mc.runtime.context_parallel import gather_from_cp
    from rlhf_mc.models.pipeline import run_pipeline
    from rlhf_mc.runtime import device

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    interleaved_pp = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 0
    replay = replay_routing and batch.routed_experts is not None
    microbatches, groups = build_microbatches(batch.rows(), micro_batch_tokens, cp, cp_rank, interleaved_pp, device(),
                                              pad_multiple(chunks[0].config),
                                              batch.rows(batch.routed_experts) if replay else None)
    if at_loss_tokens:
        align_to_predictions(batch, {}, microbatches, groups)
    cp_group = ps.get_context_parallel_group()

    def per_token(mb, output):
        cu = mb["packed"].cu_seqlens
        values = {k: gather_from_cp(v.unsqueeze(0), cp_group, 1, cu)[0].cpu() for k, v in head(mb, output).items()}
        return torch.zeros((), device=output.device), values

    for chunk in chunks:
        chunk.eval()
    reports = run_pipeline(chunks, microbatches, per_token, forward_only=True,
                           routing=Routing(replay=True) if replay else None)
    # The last pipeline stage computed the results; every stage gets them.
    payload = [reports]
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast_object_list(payload, src=dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1),
                                   group=pp_group)
    rows: dict[str, list] = {k: [None] * len(batch) for k in (payload[0][0] if payload[0] else {})}
    for mb, group, report in zip(microbatches, groups, payload[0]):
        for k, v in report.items():
            # position t's value is token t + 1's: one place later, and 0 at each sequence's first token
            shifted = v.roll(1, 0)
            shifted[mb["packed"].cu_seqlens[:-1]] = 0
            for i, part in zip(group, mb["packed"].unpack(shifted)):
                rows[k][i] = part
    return {k: torch.cat(v) for k, v in rows.items()}


def compute_log_prob(chunks: list[torch.nn.Module], batch: Trajectories, temperature: float = 1.0,
                     with_entropy: bool = False, micro_batch_tokens: int = 8192, replay_routing: bool = False
                     ) -> dict[str, torch.Tensor]:
    """Per token of the batch, "logprobs" (and "entropy" of the distribution it was drawn from): log p(token_t |
    tokens_<t) with logits / temperature (rollout/base.py semantics), at the loss-mask tokens (0 at the others:
    the prompt's logits are not computed)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()

    def head(mb, logits):
        logprobs, entropy = head_logprobs(mb, logits, tp_group, temperature, with_entropy)
        return {"logprobs": logprobs, **({"entropy": entropy} if with_entropy else {})}

    return forward_per_token(chunks, batch, head, micro_batch_tokens, replay_routing, at_loss_tokens=True)


def compute_values(chunks: list[torch.nn.Module], batch: Trajectories, micro_batch_tokens: int = 8192
                   ) -> dict[str, torch.Tensor]:
    """Critic (a model built with value_head=True): per token, "values": the value of the state before it."""
    return forward_per_token(chunks, batch, lambda mb, out: {"values": out[0, :, 0].float()}, micro_batch_tokens)


class HostReference:
    """The frozen reference weights kept in host memory; swapped into the actor's modules for a reference forward
    (no second model on the device). Take it right after loading the initial weights."""

    def __init__(self, chunks: list[torch.nn.Module]):
        pin = torch.cuda.is_available()
        self.weights = [{name: p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone()
                         for name, p in _weights(chunk)} for chunk in chunks]

    @contextlib.contextmanager
    def swapped_in(self, chunks: list[torch.nn.Module]):
        """Within the block the chunks hold the reference weights; after it, the actor's again (bit for bit)."""
        backup = [{name: p.detach().to("cpu", copy=True) for name, p in _weights(chunk)} for chunk in chunks]
        try:
            with torch.no_grad():
                for chunk, weights in zip(chunks, self.weights):
                    for name, p in _weights(chunk):
                        p.copy_(weights[name], non_blocking=True)
            yield
        finally:
            with torch.no_grad():
                for chunk, weights in zip(chunks, backup):
                    for name, p in _weights(chunk):
                        p.copy_(weights[name], non_blocking=True)
