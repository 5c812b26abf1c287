"""Megatron-Core GPTModel for the current rank, from a ModelConfig and a ParallelConfig.

Transformer Engine's layer spec when TE imports, Megatron's local spec otherwise (with our core attention, which adds
context parallelism and packed sequences); the choice is logged once per process with its reason. Sequence
parallelism is on with TE at TP > 1 (the local spec's norms would need apex). One model chunk per virtual pipeline
stage.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from rlhf_mc.config import ConfigError, ModelConfig, ParallelConfig, RouterConfig
from rlhf_mc.models import head

Dtype = Literal["float32", "bfloat16"]
Recompute = Literal["none", "full", "selective"]


log = logging.getLogger(__name__)


@functools.cache
def layer_impl() -> tuple[bool, str]:
    """(use Transformer Engine, why): TE when it imports with CUDA; everything else in the package works without
    it. Logged once per process: a TE that fails to import on a GPU machine is a warning, not a silent fallback."""
    if not torch.cuda.is_available():
        use, why = False, "local layer spec: no CUDA device (Transformer Engine needs one)"
    else:
        try:
            import transformer_engine
            import transformer_engine.pytorch  # noqa: F401
        except Exception as error:  # noqa: BLE001 - any failure means: not usable here
            use, why = False, f"local layer spec: Transformer Engine does not import ({type(error).__name__}: {error})"
        else:
            use, why = True, f"Transformer Engine layer spec (transformer_engine {transformer_engine.__version__})"
    (log.info if use or not torch.cuda.is_available() else log.warning)(why)
    return use, why


def te_available() -> bool:
    return layer_impl()[0]


def _router_gemm_without_te() -> None:
    """Megatron-Core 0.16.1's moe_utils defines te_general_gemm only when Transformer Engine imports, yet its fp32
    router gating (RouterGatingLinearFunction) tests `te_general_gemm is not None` (NameError without TE; 0.19 defines
    it as None). Define it as None there, as later releases do."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_fields(model: ModelConfig, router: RouterConfig, use_te: bool) -> dict:
    """TransformerConfig's mixture-of-experts fields (none for a dense model).

    HF's Qwen3-MoE router: softmax over all experts, top-k, renormalized over the k when norm_topk_prob. Megatron's
    top-k-then-softmax (moe_router_pre_softmax=False) is that renormalization; pre-softmax without scaling is the
    unnormalized one. DeepSeek-V3 style: sigmoid scores (renormalized over the k), the expert bias added for the
    choice only, groups scored by their best two experts, the scaling factor on the weights; the bias moves by
    router.bias_update_rate after each step (Megatron's auxiliary-loss-free balancing; 0: frozen). Routing in fp32
    (bf16 router logits flip near-tied experts). Experts whole on each rank (expert tensor parallel 1); TE's grouped
    GEMM on GPU, Megatron's per-expert MLPs otherwise (the fused permute/router kernels are CUDA-only). Megatron's
    RouterReplay in every router: models/routing.py replays or records the engine's routing through it (without an
    action set, routing is the router's own)."""
    if not model.num_experts:
        return {}
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_score_function=model.moe_router_score,
        moe_router_pre_softmax=model.moe_router_score == "softmax" and not model.moe_norm_topk_prob,
        moe_router_enable_expert_bias=model.moe_expert_bias,
        moe_router_bias_update_rate=router.bias_update_rate,
        moe_router_num_groups=model.moe_groups if model.moe_groups > 1 else None,
        moe_router_group_topk=model.moe_group_topk if model.moe_groups > 1 else None,
        moe_router_topk_scaling_factor=model.moe_routed_scaling if model.moe_routed_scaling != 1 else None,
        moe_shared_expert_intermediate_size=model.moe_shared_ffn_hidden_size or None,
        moe_layer_freq=[int(i not in model.dense_layer_ids) for i in range(model.num_layers)],
        moe_router_dtype="fp32",
        expert_tensor_parallel_size=1,
        moe_grouped_gemm=use_te,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_router_load_balancing_type=router.load_balancing if router.aux_loss_coef else "none",
        moe_aux_loss_coeff=router.aux_loss_coef,
        moe_z_loss_coeff=router.z_loss_coef or None,
        moe_enable_routing_replay=True,
    )


def mla_fields(model: ModelConfig) -> dict:
    """MLATransformerConfig's multi-latent attention fields (none without). Its q/kv latents always have norms
    (qk_layernorm); its rotary embedding (its own, over the qk_rope_head_dim dims) rotates interleaved pairs, as
    DeepSeek-V3's checkpoints expect (rope_utils: mla_rotary_interleaved), YaRN-scaled as theirs are."""
    if not model.kv_lora_rank:
        return {}
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear, type):
        raise ConfigError("kv_lora_rank: multi-latent attention without Transformer Engine needs Megatron-Core >= 0.19 "
                          "(0.16.1 believes TE imported and tests isinstance against its placeholder TELinear)")
    fields = dict(q_lora_rank=model.q_lora_rank or None, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.head_dim,
                  qk_pos_emb_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim, rope_type="rope",
                  rotary_base=model.rope_theta)
    scaling = model.rope_scaling
    if scaling is not None:  # yarn (ModelConfig allows no other here)
        fields.update(rope_type="yarn", rotary_scaling_factor=scaling.factor, beta_fast=scaling.beta_fast,
                      beta_slow=scaling.beta_slow, mscale=scaling.mscale, mscale_all_dim=scaling.mscale_all_dim,
                      original_max_position_embeddings=scaling.original_max_position_embeddings)
    return fields


def transformer_config(model: ModelConfig, parallel: ParallelConfig, dtype: Dtype = "float32",
                       recompute: Recompute = "none", init_weights: bool = True, use_te: bool = False,
                       router: RouterConfig = RouterConfig()):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    on_cpu = not torch.cuda.is_available()
    params_dtype = getattr(torch, dtype)
    return (MLATransformerConfig if model.kv_lora_rank else TransformerConfig)(
        **moe_fields(model, router, use_te),
        **mla_fields(model),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm or bool(model.kv_lora_rank),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        # The local spec's norms have no sequence-parallel form without apex: SP only with TE.
        sequence_parallel=use_te and parallel.tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bfloat16",
        # Packed micro-batches differ in length: the pipeline communicates shapes. Except with the interleaved
        # (VPP) schedule, where the shape messages hung on gloo (measured, PP=2 x VPP=2): there every micro-batch
        # must have the same length (run_pipeline checks).
        variable_seq_lengths=parallel.vpp == 1,
        moe_token_dispatcher_type="alltoall",  # the only dispatcher Megatron allows with variable lengths
        # Gloo with interleaved pipelines gives silently wrong gradients with batched p2p (measured).
        batch_p2p_comm=not on_cpu,
        use_cpu_initialization=on_cpu,
        perform_initialization=init_weights,
        # Fused kernels are CUDA-only, but for SwiGLU's: on GPU Megatron's (torch.compile), on CPU ours
        # (models/swiglu.py, installed by build_model: compiling costs 1.5-19 s per process there).
        masked_softmax_fusion=not on_cpu,
        bias_activation_fusion=True,
        bias_dropout_fusion=not on_cpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
    )


def layer_spec(model: ModelConfig, use_te: bool, config, vp_stage: int | None):
    """A dense model's layer spec; a mixture-of-experts model's block spec for this pipeline stage (its layers may
    be dense or MoE: config.moe_layer_freq). Local specs get our core attention, and so do TE specs of an fp32
    model: TE has no attention backend for fp32 with packed (THD) input (its unfused attention refuses THD, its
    flash and fused ones fp32), so such a model would fail at its first forward."""
    from megatron.core.models.gpt import gpt_layer_specs

    local_attention = not use_te or not (config.bf16 or config.fp16)
    if model.num_experts:
        from megatron.core import parallel_state

        block = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_te, normalization="RMSNorm", vp_stage=vp_stage,
            pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        if not local_attention:
            return block
        return dataclasses.replace(block, layer_specs=[_local_attention(s) for s in block.layer_specs])
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization="RMSNorm")
    return _local_attention(spec) if local_attention else spec


def _local_attention(spec):
    from rlhf_mc.models.attention import LocalCoreAttention

    attention = spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=LocalCoreAttention)
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attention, submodules=submodules)))


def build_model(model: ModelConfig, parallel: ParallelConfig, dtype: Dtype = "float32",
                recompute: Recompute = "none", use_te: bool | None = None, init_weights: bool = True,
                value_head: bool = False, router: RouterConfig = RouterConfig()) -> list[torch.nn.Module]:
    """The GPTModel chunks this rank owns (one per virtual pipeline stage), on the current device.

    bf16 models are wrapped in Megatron's Float16Module (fp32 logits out). `init_weights=False` leaves the weights
    uninitialized, for a checkpoint to fill (faster, and no full-size init buffers). `value_head=True` replaces the
    vocabulary projection by a scalar head (critic, reward model): the model outputs [b, s, 1]. `router`: the
    router's training losses (mixture-of-experts models).
    Needs init_parallel() first.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from rlhf_mc.models.norm import use_fused_rms_norm
    from rlhf_mc.models.rope import use_packed_rotary
    from rlhf_mc.models.swiglu import use_eager_swiglu

    parallel.check_model(model)
    use_packed_rotary()
    if not torch.cuda.is_available():
        use_eager_swiglu()
    if model.num_experts:
        _router_gemm_without_te()
    use_te = te_available() if use_te is None else use_te
    config = transformer_config(model, parallel, dtype, recompute, init_weights, use_te, router)
    chunks = []
    for vp_stage in range(parallel.vpp):
        vp = vp_stage if parallel.vpp > 1 else None
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(model, use_te, config, vp),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=model.tie_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=int(model.rope_theta),
            rope_scaling=model.rope_scaling is not None and not model.kv_lora_rank,  # MLA: its own (mla_fields)
            rope_scaling_factor=model.rope_scaling.factor if model.rope_scaling else 8.0,
            rotary_percent=model.rotary_percent,
            vp_stage=vp,
        )
        if value_head and gpt.post_process:
            gpt.output_layer = ValueHead(config, init_weights)
        elif gpt.post_process:
            head.select_positions(gpt.output_layer)
        if torch.cuda.is_available():
            gpt.cuda(torch.cuda.current_device())
        else:  # torch has no RMSNorm kernel on CPU (models/norm.py); on GPU its fused one, or TE's, runs
            use_fused_rms_norm(gpt)
        chunks.append(Float16Module(config, gpt) if config.bf16 else gpt)
    return chunks


class ValueHead(MegatronModule):
    """hidden [s, b, h] -> value [s, b, 1]; replicated over TP (its input, the final hidden state, is)."""

    def __init__(self, config, init_weights: bool = True):
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        if init_weights:
            config.init_method(self.weight)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        # Same call signature and (output, bias) result as the vocabulary projection it replaces, which gathers a
        # sequence-parallel input over TP first: so does the head.
        if self.config.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden)
        return torch.nn.functional.linear(hidden, self.weight), None
