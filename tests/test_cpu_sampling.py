"""The inverse-CDF sampling of CPU SGLang servers (rollout/cpu_sampling.py): frequencies against hand-set
probabilities, zero-probability tokens never drawn (at the draw's extremes too), seeded draws left to SGLang. (The
engine test in test_rollout.py checks the server's sampled tokens against transformers' distribution.)"""

from __future__ import annotations

import torch

from rlhf_mc.rollout import cpu_sampling

# unnormalized rows (SGLang's probs after temperature need not sum to exactly 1), zeros first, inside and last
ROWS = torch.tensor([[0.0, 0.2, 0.0, 1.2, 0.6, 0.0],
                     [0.5, 0.0, 0.0, 0.0, 0.0, 1.5]])


def test_frequencies_follow_the_probabilities():
    torch.manual_seed(0)
    draws = 100_000
    tokens = cpu_sampling.inverse_cdf(ROWS.repeat_interleave(draws, 0)).view(2, draws)
    assert tokens.dtype == torch.int32
    for row, drawn in zip(ROWS, tokens):
        frequency = torch.bincount(drawn.long(), minlength=row.numel()) / draws
        expected = row / row.sum()
        # binomial standard deviation <= 0.0016 at 100k draws: 5 of them
        assert (frequency - expected).abs().max() < 0.008, (frequency, expected)
        assert (frequency[expected == 0] == 0).all()


def test_extreme_draws_stay_on_tokens_with_probability(monkeypatch):
    for u, expected in ((0.0, [1, 0]), (1 - 2 ** -24, [4, 5])):  # torch.rand's smallest and largest float32
        monkeypatch.setattr(torch, "rand", lambda shape, u=u, **kw: torch.full(shape, u, **kw))
        assert cpu_sampling.inverse_cdf(ROWS).tolist() == expected
        assert cpu_sampling.inverse_cdf(ROWS * 3.7).tolist() == expected  # a total that is no power of two


def test_seeded_draws_are_sglangs(monkeypatch):
    from rlhf_mc.rollout.cpu import CPU_SITE

    monkeypatch.syspath_prepend(str(CPU_SITE))  # the sampler imports sgl_kernel (the server's stand-in there)
    from sglang.srt.layers import sampler

    calls = []

    def sglangs(probs, sampling_seed=None, positions=None):  # in place of SGLang's (its seeded op is CUDA-only)
        calls.append((sampling_seed, positions))
        return torch.zeros(probs.size(0), dtype=torch.int32)

    assert callable(sampler.sampling_from_probs_torch)  # the name install() replaces
    monkeypatch.setattr(sampler, "sampling_from_probs_torch", sglangs)  # restored afterwards
    cpu_sampling.install(sampler)
    cpu_sampling.install(sampler)  # idempotent: SGLang's stays the one kept
    assert sampler.sampling_from_probs_torch is cpu_sampling.sampling_from_probs
    seeds, positions = torch.tensor([3, 7]), torch.tensor([0, 5])
    assert sampler.sampling_from_probs_torch(ROWS, seeds, positions).tolist() == [0, 0]
    assert calls == [(seeds, positions)]
    torch.manual_seed(0)
    assert sampler.sampling_from_probs_torch(ROWS).tolist() in ([1, 0], [3, 0], [4, 0], [1, 5], [3, 5], [4, 5])
    assert len(calls) == 1
