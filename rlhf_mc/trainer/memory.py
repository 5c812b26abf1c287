"""What a GPU of the run holds, estimated from the recipe before any process starts (the plan prints it): each
trained role's weights, gradients and optimizer state per rank, a separate reference's weights, and the engines'
static memory (their weights and KV cache: SGLang's mem_fraction_static of the GPU), in the two phases of a step
on a colocated GPU: while the engines generate (offloaded roles in host memory, the engines' memory in use) and
while the roles train (the engines' memory released). Activations, the log-prob head's chunks, the CUDA context and
the reward model or teacher (sized from their checkpoints at launch) come on top.

Megatron's layout as models/gpt.py and optim.py build it: gradients accumulate in fp32 (grad_reduce_in_fp32),
Adam keeps two fp32 moments and, for a 16-bit model, an fp32 master copy, sharded over the data-parallel ranks by
the distributed optimizer; non-expert weights are split over tp x pp, experts over ep x pp (expert TP is 1)."""

from __future__ import annotations

import dataclasses

from rlhf_mc.config import ModelConfig, ParallelConfig
from rlhf_mc.models.lora import adapter_numel
from rlhf_mc.trainer.recipe import Recipe, TrainSection

GIB = 2**30
FIX = ("actor.offload=true (and critic.offload, ref.offload) to give the engines the roles' memory while they "
       "generate, or a lower rollout.engine.mem_fraction_static")


def _bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def _expert_parameters(model: ModelConfig) -> int:
    return (model.num_layers - len(model.dense_layer_ids)) * model.num_experts * 3 * model.hidden_size * \
        model.moe_ffn_hidden_size if model.num_experts else 0


def _per_rank(model: ModelConfig, parallel: ParallelConfig) -> float:
    """Parameters on one rank, the layers split evenly over the pipeline stages."""
    experts = _expert_parameters(model)
    return ((model.num_parameters - experts) / parallel.tp + experts / parallel.ep) / parallel.pp


@dataclasses.dataclass(frozen=True)
class RoleMemory:
    role: str
    weights: float  # bytes on one rank
    grads: float
    optimizer: float
    offloaded: bool  # in host memory while the engines generate

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def trained_role(role: str, section: TrainSection, model: ModelConfig, dtype: str, world: int) -> RoleMemory:
    """A trained role's bytes on one of its `world` ranks."""
    trained = _per_rank(model, section.parallel)
    weights = trained * _bytes(dtype)
    if section.lora.enabled:  # the base frozen: gradients and Adam for the adapters alone
        trained = adapter_numel(model, section.lora) / (section.parallel.tp * section.parallel.pp)
        weights += trained * _bytes(dtype)
    optimizer_bytes = 8 + (4 if _bytes(dtype) == 2 else 0)  # two fp32 moments, and the fp32 master copy
    shards = section.parallel.dp(world) if section.optim.use_distributed_optimizer else 1
    return RoleMemory(role, weights, trained * 4, trained * optimizer_bytes / shards, section.offload)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    roles: list[RoleMemory]  # on every training GPU
    engine_static: float | None  # bytes on each engine GPU; None: SGLang's own default share (not known here)
    engine_weights: float
    kv_bytes_per_token: float
    colocated: bool
    gpu: float | None  # bytes of one GPU; None where not known (no GPU here, resources.gpu_memory_gib unset)

    @property
    def generating(self) -> float:
        """A training GPU while the engines generate (colocated: with the engine's static memory)."""
        held = sum(r.total for r in self.roles if not r.offloaded)
        return held + (self.engine_static or 0) if self.colocated else held

    @property
    def training(self) -> float:
        return sum(r.total for r in self.roles)

    @property
    def peak(self) -> float:
        engine_gpu = 0 if self.colocated else self.engine_static or 0
        return max(self.generating, self.training, engine_gpu)

    def lines(self) -> list[str]:
        def gib(x: float) -> str:
            return f"{x / GIB:.1f}"

        rows = ["memory per GPU (estimate; activations, the CUDA context, a reward model or teacher come on top):"]
        for r in self.roles:
            rows.append(f"  {r.role} {gib(r.total)} GiB (weights {gib(r.weights)}, gradients {gib(r.grads)}, "
                        f"optimizer {gib(r.optimizer)})" + ("; offloaded while the engines generate" if r.offloaded
                                                            else ""))
        if self.engine_static is None:
            rows.append(f"  engine: weights {gib(self.engine_weights)} GiB and SGLang's default share of the GPU for "
                        "its KV cache (rollout.engine.mem_fraction_static plans it)")
        else:
            kv = self.engine_static - self.engine_weights
            rows.append(f"  engine static {gib(self.engine_static)} GiB (weights {gib(self.engine_weights)}, KV cache "
                        f"{gib(kv)}: ~{max(kv, 0) / self.kv_bytes_per_token / 1e3:.0f}k tokens)")
        where = "on a GPU shared with the engines" if self.colocated else "on a training GPU"
        rows.append(f"  {where}: {gib(self.generating)} GiB while the engines generate, {gib(self.training)} GiB "
                    "while training")
        if self.gpu is None:
            rows.append("  no GPU here to compare with: resources.gpu_memory_gib gives the cluster's")
        elif self.peak > self.gpu:
            rows.append(f"WARNING: {gib(self.peak)} GiB exceeds the {gib(self.gpu)} GiB GPU; set {FIX}")
        return rows


def estimate_memory(recipe: Recipe, model: ModelConfig, actor_world: int, colocated: bool,
                    gpu: float | None) -> MemoryEstimate:
    dtype = recipe.model.dtype
    roles = [trained_role("actor", recipe.actor, model, dtype, actor_world)]
    if recipe.uses_critic:
        roles.append(trained_role("critic", recipe.critic, model, dtype, actor_world))
    if recipe.uses_reference and recipe.ref.placement == "separate":
        roles.append(RoleMemory("reference", _per_rank(model, recipe.ref.parallel) * _bytes(dtype), 0, 0,
                                recipe.ref.offload))
    engine = recipe.rollout.engine
    engine_bytes = _bytes(dtype if engine.dtype == "auto" else engine.dtype)
    static = engine.mem_fraction_static * gpu if engine.mem_fraction_static is not None and gpu else None
    if model.kv_lora_rank:  # multi-latent attention: one latent and its rotary part a token and layer, on every rank
        per_token = model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * engine_bytes
    else:  # keys and values of the TP rank's KV heads (replicated where there are fewer than tp)
        per_token = 2 * model.num_layers * max(model.num_kv_heads // engine.tp, 1) * model.head_dim * engine_bytes
    return MemoryEstimate(roles, static, model.num_parameters * engine_bytes / engine.tp, per_token, colocated, gpu)
