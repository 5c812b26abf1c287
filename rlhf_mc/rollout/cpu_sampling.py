"""Token sampling for SGLang's CPU servers: one uniform draw per request and a search in the row's cumulative sum.

SGLang 0.5.23's plain sampling (no top-k, top-p or min-p: `layers/sampler.py:sampling_from_probs_torch`) draws one
exponential per vocabulary entry (the Gumbel-max trick; torch.multinomial with SGLANG_OPT_USE_GUMBEL_SAMPLE=0), and
torch draws them on one core: for 256 requests, 10 ms per decode step over a 2048-token vocabulary (a sixth of a 6M
model's decode step) and 240 ms over SmolLM2's 49152 (multinomial: 9 and 232 ms). The inverse CDF takes 0.25 and 20
ms (measured here). Its float32 cumulative sum drifts with the vocabulary's length, but each token's interval is
its own probability rounded once (a boundary moves with the drift, not the interval's width), and the draw is
scaled by the row's computed total. Seeded sampling (per-request seeds) stays SGLang's. Installed in the server's
processes by rollout/cpu_site/sitecustomize.py.
"""

from __future__ import annotations

import torch


def inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [requests, vocab] (rows need not sum to 1): int32 [requests]. A token of
    probability 0 is never drawn (a row without any positive entry, NaN included, gets the last token: in range,
    as SGLang's argmax gives some token)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # torch.rand < 1 by at least its dtype's unit in the last place, so the rounded product stays below the total:
    # the first entry above the draw ends a non-empty interval
    draw = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * total
    token = torch.searchsorted(cdf, draw, right=True).clamp_(max=probs.size(-1) - 1)
    return token.view(-1).to(torch.int32)


def install(sampler_module) -> None:
    """Replaces sampler_module.sampling_from_probs_torch for unseeded draws (idempotent)."""
    global _sglang_sampling
    if sampler_module.sampling_from_probs_torch is sampling_from_probs:
        return
    _sglang_sampling = sampler_module.sampling_from_probs_torch
    sampler_module.sampling_from_probs_torch = sampling_from_probs


def sampling_from_probs(probs: torch.Tensor, sampling_seed: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """SGLang's sampling_from_probs_torch (same signature and result type)."""
    if sampling_seed is not None:
        return _sglang_sampling(probs, sampling_seed, positions)
    return inverse_cdf(probs)


_sglang_sampling = None  # SGLang's own, set by install()
