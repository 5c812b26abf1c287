"""models/cpu_kernels.py: which calls run compiled (a CPU input of COMPILE_FROM elements or more) and that a compiled
call gives the function's numbers. The kernels' own accuracy: test_norm.py, test_swiglu.py, test_rope.py."""

from __future__ import annotations

import torch

from rlhf_mc.models.cpu_kernels import COMPILE_FROM, cpu_kernel


def test_only_large_cpu_inputs_are_compiled():
    from torch._dynamo.utils import counters

    @cpu_kernel
    def scaled_square(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * x * scale

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    start = graphs()
    small = torch.arange(COMPILE_FROM - 1, dtype=torch.float32)
    assert torch.equal(scaled_square(small, 0.5), small * small * 0.5)
    assert graphs() == start  # uncompiled
    for n in (COMPILE_FROM, COMPILE_FROM + 1000):  # one graph for both sizes (dynamic shapes)
        large = torch.linspace(-3, 3, n)
        torch.testing.assert_close(scaled_square(large, 0.5), large * large * 0.5, rtol=0, atol=0)
    assert graphs() == start + 1
