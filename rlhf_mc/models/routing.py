"""Rollout routing replay for mixture-of-experts models, on Megatron-Core's RouterReplay.

The rollout engine returns, per token, the experts it routed the token to in every layer (rollout/base.py
RolloutSample.routed_experts). With replay on, the trainer's routers take those experts instead of their own top-k:
the router's probabilities are gathered at the replayed experts, so the router still gets gradients; with it off,
the routers record their own choice, and the share of (token, layer) expert choices the two agree on is counted
(an engine/trainer mismatch the log-probs alone do not show).

A micro-batch's routing is [its tokens (this CP rank's part), layers * top-k] int16, in the model's layer order; -1
marks tokens the engine never ran (each sequence's last token, padding): they replay experts 0..k-1 (their outputs
feed no loss: attention is causal and nothing is predicted from the last token) and are not compared.
Replay needs activation recompute off: a recomputed forward would replay the routing of a later micro-batch.
"""

from __future__ import annotations

import dataclasses

import torch

from rlhf_mc.runtime import host_all_reduce


def _routers(chunk: torch.nn.Module) -> list:
    return [m for m in chunk.modules() if getattr(m, "router_replay", None) is not None]


@dataclasses.dataclass
class Routing:
    """What the forward passes of one pipeline run do with the engine's routing (models/pipeline.run_pipeline)."""

    replay: bool
    matches: int = 0  # (token, layer, expert) choices of the trainer's routers that the engine made too
    choices: int = 0

    def before_forward(self, chunk: torch.nn.Module, routing: torch.Tensor) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in _routers(chunk):
            if self.replay:
                ids = self._layer(router, routing)
                filler = torch.arange(ids.size(1), dtype=ids.dtype, device=ids.device).expand_as(ids)
                router.router_replay.set_target_indices(torch.where(ids < 0, filler, ids).long())
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def after_forward(self, chunk: torch.nn.Module, routing: torch.Tensor) -> None:
        for router in _routers(chunk):
            if not self.replay:
                ids = self._layer(router, routing)
                chosen = router.router_replay.get_recorded_indices().to(ids.device)
                known = ids[:, 0] >= 0
                self.matches += int((chosen[known].unsqueeze(-1) == ids[known].unsqueeze(-2)).any(-1).sum())
                self.choices += int(known.sum()) * ids.size(1)
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    @staticmethod
    def _layer(router, routing: torch.Tensor) -> torch.Tensor:
        """[tokens the router sees, top-k]: its layer's columns; with sequence parallelism its TP rank's share of
        the tokens."""
        from megatron.core import parallel_state as ps

        config = router.config
        ids = routing.view(routing.size(0), -1, config.moe_router_topk)[:, router.layer_number - 1].to(torch.long)
        if config.sequence_parallel:
            ids = ids.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
        return ids

    def agreement(self, sequence_parallel: bool) -> float:
        """The share of the trainer's expert choices the engine made, over every rank of the model (collective;
        with sequence parallelism the TP ranks saw different tokens)."""
        from megatron.core import parallel_state as ps

        groups = [ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)]
        if sequence_parallel:
            groups.append(ps.get_tensor_model_parallel_group())
        counts = host_all_reduce(torch.tensor([self.matches, self.choices], dtype=torch.float64), *groups)
        return float(counts[0] / counts[1].clamp(min=1))
