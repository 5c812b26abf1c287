"""Process setup: torch.distributed, Megatron parallel_state, seeds, and the CPU shims for Megatron-Core."""

from rlhf_mc.runtime.distributed import destroy, device, host_all_reduce, init_distributed, init_parallel, set_seed

__all__ = ["destroy", "device", "host_all_reduce", "init_distributed", "init_parallel", "set_seed"]
