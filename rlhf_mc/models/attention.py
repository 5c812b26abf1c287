"""Core attention for Megatron's local (non-Transformer-Engine) layer spec.

Megatron-Core's own DotProductAttention refuses context parallelism and packed (THD) input; this module supports both,
so CP and packing work without TE:
- CP: K and V are all-gathered over the CP group (backward: the matching reduce-scatter); every query attends to the
  keys whose global position is not after its own, with Megatron's load-balanced chunk layout
  (runtime/context_parallel.py).
- THD: `packed_seq_params.cu_seqlens_q(_padded)` gives the boundaries of the packed sequences (full, padded lengths,
  before the CP split); attention is causal within each sequence and never crosses one.
Attention is always causal and ignores `attention_mask`: padded batches must be padded on the right.

Without CP, a pack on CPU without gradients (log-prob passes) takes models/cpu_causal_attention.py's kernel,
which skips the masked keys that SDPA's CPU kernel computes. Otherwise each run of consecutive packed sequences of
equal length is attended as one batch with `is_causal` (SDPA's fused kernel, no mask), on a view of the pack. A
block-diagonal mask over a packed run would make the kernel compute every whole block (3.9x the needed work on an
8k-token micro-batch of 32-512-token sequences); gathering sequences of similar length into padded batches (what
this module did before) cost more in gathers than it saved in kernel calls (CPU, 2 threads: 1.3-2x slower forward and
backward at 200 sequences of 8-300 tokens, even at 8-40). The micro-batcher packs sequences longest first
(data/microbatch.py), so equal lengths are adjacent.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from rlhf_mc.models import cpu_causal_attention
from rlhf_mc.runtime.context_parallel import cp_positions


BLOCK_TOKENS = 1024
# On CPU, SDPA's bf16 backward costs a fixed ~0.06 ms per (sequence, head) more than its fp32 one (8192 tokens x 8
# heads, forward + backward: 16-token sequences 132 ms in bf16 against 10 in fp32, 64: 75 / 13, 256: 54 / 38, 512:
# 72 / 68, 1024: 71 / 94): with gradients, shorter sequences are attended in fp32.
CPU_BF16_GRAD_IN_FP32_BELOW = 512


def _blocks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of sequence lengths whose sum stays within max_tokens (a longer sequence is a run alone)."""
    blocks: list[list[int]] = []
    for n in lengths:
        if blocks and sum(blocks[-1]) + n <= max_tokens:
            blocks[-1].append(n)
        else:
            blocks.append([n])
    return blocks


class _GatherFromCP(torch.autograd.Function):
    """[...] -> [cp, ...]: every rank's tensor; backward sums the gradients and keeps this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce_scatter
        return grad[dist.get_rank(ctx.group)], None


class LocalCoreAttention(MegatronModule):
    """Drop-in for megatron.core.transformer.dot_product_attention.DotProductAttention (same constructor)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None,
                 k_channels: int | None = None, v_channels: int | None = None):
        # k_channels / v_channels: multi-latent attention's query-key and value head dims (they differ; the
        # attention below does not depend on either)
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"LocalCoreAttention supports causal attention only, got {attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp"])
        self.cp_group = pg_collection.cp
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None):
        if attention_bias is not None:
            raise ValueError("LocalCoreAttention does not support attention_bias")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        if cp_size > 1:
            key, value = _GatherFromCP.apply(key, self.cp_group), _GatherFromCP.apply(value, self.cp_group)
        else:
            key, value = key.unsqueeze(0), value.unsqueeze(0)
        # key/value: [cp, local_tokens, ...] from here on.

        if packed_seq_params is None:  # sbhd: query [s_local, b, heads, d] -> out [s_local, b, heads*d]
            if cp_size == 1:
                out = self._sdpa(query.permute(1, 2, 0, 3), key[0].permute(1, 2, 0, 3), value[0].permute(1, 2, 0, 3),
                                 is_causal=True)
                return out.permute(2, 0, 1, 3).flatten(2)
            s_local = query.size(0)
            q_pos, k_pos = self._positions(s_local * cp_size, cp_size, cp_rank, query.device)
            k = key.flatten(0, 1).permute(1, 2, 0, 3)  # [b, groups, cp*s_local, d]
            v = value.flatten(0, 1).permute(1, 2, 0, 3)
            out = self._attend(query.permute(1, 2, 0, 3), k, v, q_pos, k_pos)  # [b, heads, s_local, d]
            return out.permute(2, 0, 1, 3).flatten(2)

        # thd: query [t_local, heads, d] -> out [t_local, heads*d]. Consecutive short sequences are attended
        # together under a block-diagonal causal mask (one kernel call instead of one per sequence); a block holds at
        # most BLOCK_TOKENS tokens (before the CP split) unless one sequence alone is longer.
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        if cp_size == 1:
            return self._packed_causal(query, key[0], value[0], (cu[1:] - cu[:-1]).tolist())
        outs, start = [], 0
        for block in _blocks((cu[1:] - cu[:-1]).tolist(), BLOCK_TOKENS):
            local = sum(block) // cp_size
            q_pos, k_pos, q_seg, k_seg = self._block_positions(block, cp_size, cp_rank, query.device)
            q = query[start:start + local].transpose(0, 1)  # [heads, local, d]
            k = key[:, start:start + local].flatten(0, 1).transpose(0, 1)  # [groups, cp*local, d]
            v = value[:, start:start + local].flatten(0, 1).transpose(0, 1)
            outs.append(self._attend(q, k, v, q_pos, k_pos, q_seg, k_seg).transpose(0, 1))
            start += local
        return torch.cat(outs).flatten(1)

    def _block_positions(self, lengths: list[int], cp_size: int, cp_rank: int, device):
        """Per-sequence positions and sequence ids of a block's local queries and gathered keys (gather order: rank
        by rank, each rank's part sequence by sequence)."""
        per_seq = [self._positions(n, cp_size, cp_rank, device) for n in lengths]
        q_pos = torch.cat([q for q, _ in per_seq])
        q_seg = torch.cat([torch.full((n // cp_size,), i, device=device) for i, n in enumerate(lengths)])
        k_pos = torch.cat([k.view(cp_size, -1)[r] for r in range(cp_size) for _, k in per_seq])
        k_seg = torch.cat([torch.full((n // cp_size,), i, device=device)
                           for _ in range(cp_size) for i, n in enumerate(lengths)])
        return q_pos, k_pos, q_seg, k_seg

    @staticmethod
    def _positions(seq_len: int, cp_size: int, cp_rank: int, device):
        """Global positions of the local queries and of the gathered keys (in gather order)."""
        if cp_size == 1:
            pos = torch.arange(seq_len, device=device)
            return pos, pos
        k_pos = torch.cat([cp_positions(seq_len, cp_size, r, device) for r in range(cp_size)])
        return cp_positions(seq_len, cp_size, cp_rank, device), k_pos

    def _packed_causal(self, query, key, value, lengths: list[int]):
        """query [t, heads, d], key/value [t, groups, d] holding `lengths` packed sequences -> [t, heads*d]."""
        if self._dropout_in_effect() == 0.0 and cpu_causal_attention.applies(query):
            return cpu_causal_attention.packed_causal_attention(query, key, value, lengths,
                                                                self.softmax_scale).flatten(1)
        runs = [(n, len(list(same))) for n, same in itertools.groupby(lengths)]
        sizes = [n * count for n, count in runs]  # one split: its backward is one cat, not a zero-fill per run
        outs = []
        for (n, count), *qkv in zip(runs, query.split(sizes), key.split(sizes), value.split(sizes)):
            q, k, v = (x.unflatten(0, (count, n)).transpose(1, 2) for x in qkv)  # [count, heads, n, d], a view
            outs.append(self._sdpa(q, k, v, is_causal=True).transpose(1, 2).flatten(0, 1))
        return torch.cat(outs).flatten(1)

    def _attend(self, q, k, v, q_pos, k_pos, q_seg=None, k_seg=None):
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # causal by global position
        if q_seg is not None:
            mask &= k_seg.unsqueeze(0) == q_seg.unsqueeze(1)  # within the same packed sequence
        return self._sdpa(q, k, v, attn_mask=mask)

    def _dropout_in_effect(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _sdpa(self, q, k, v, **mask):
        if (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.requires_grad and torch.is_grad_enabled()
                and q.size(-2) < CPU_BF16_GRAD_IN_FP32_BELOW):
            return self._sdpa(q.float(), k.float(), v.float(), **mask).to(q.dtype)
        dropout_p = self._dropout_in_effect()
        if dropout_p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, enable_gqa=True, **mask)
        with tensor_parallel.get_cuda_rng_tracker().fork():  # heads differ per TP rank: use the TP-rank stream
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=self.softmax_scale,
                                                  enable_gqa=True, **mask)
