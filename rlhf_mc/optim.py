"""Megatron's DDP, (distributed) optimizer and learning-rate schedule, wired from an OptimizerConfig."""

from __future__ import annotations

import dataclasses

import torch

from rlhf_mc.config import OptimizerConfig


@dataclasses.dataclass
class TrainState:
    """What a training step needs besides the data: DDP-wrapped chunks, the optimizer, the lr schedule."""

    model: list  # DistributedDataParallel chunks, one per virtual pipeline stage
    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: object  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler

    def zero_grad(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict:
        """Optimizer step (with clipping) and lr schedule step; returns grad norm, lr and whether it applied."""
        applied, grad_norm, _ = self.optimizer.step()
        if applied:
            self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "lr": self.optimizer.param_groups[0]["lr"], "update_applied": bool(applied)}


def setup_training(chunks: list[torch.nn.Module], cfg: OptimizerConfig) -> TrainState:
    """Wraps model chunks (from models.gpt.build_model) in Megatron DDP and builds optimizer and schedule.

    Gradients are reduced in fp32 and averaged over the data-parallel (x context-parallel) group; Megatron's
    pipeline schedule calls finalize_model_grads (DP reduction, tied-embedding and layernorm grads across stages).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=i > 0)  # as Megatron's training loop does for VPP
             for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps, clip_grad=cfg.clip_grad,
            bf16=config.bf16, params_dtype=config.params_dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer),
        model)
    decay_steps = cfg.lr_decay_steps or cfg.lr_warmup_steps + 1  # Megatron needs decay > warmup steps
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
