"""How a rank on a machine without a GPU uses the host: its share of the cores, and glibc's allocator told to keep
freed memory.

glibc returns a freed block of 32 MB or more (an 8k-token micro-batch's MLP activations or logits) and the top of the
heap over 128 KB to the kernel at once, so the next micro-batch faults every page in again. Measured with getrusage
on bench/ref_logprob.py's workload (300 sequences, 8192-token micro-batches): 2.9-3.8M minor faults and 8-10 s of
system time with glibc's defaults, 0.6-0.7M and 2-2.6 s with these settings (user time unchanged).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

# mallopt parameter -> value; the environment variable of the same setting for processes we exec (SGLang servers)
MALLOC = {
    -1: ("MALLOC_TRIM_THRESHOLD_", 256 << 20),  # M_TRIM_THRESHOLD: keep up to 256 MB free at the heap top
    -2: ("MALLOC_TOP_PAD_", 64 << 20),  # M_TOP_PAD: grow the heap 64 MB at a time
    -3: ("MALLOC_MMAP_THRESHOLD_", 32 << 20),  # M_MMAP_THRESHOLD: glibc's largest; blocks below it reuse the heap
}


def cores_per(ranks_on_host: int) -> int:
    """An equal share of this machine's cores: N processes each with every core's worth of threads thrash."""
    return max(1, (os.cpu_count() or 1) // ranks_on_host)


def use_host(ranks_on_host: int) -> None:
    """Called first in every CPU rank: its share of the cores (Ray sets OMP_NUM_THREADS=1) and the allocator
    settings above."""
    torch.set_num_threads(cores_per(ranks_on_host))
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):  # glibc only
        for param, (_, value) in MALLOC.items():
            libc.mallopt(param, value)


def malloc_env() -> dict[str, str]:
    """The same allocator settings for a process started with exec."""
    return {name: str(value) for name, value in MALLOC.values()}
