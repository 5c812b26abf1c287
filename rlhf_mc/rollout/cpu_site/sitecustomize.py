"""Imported at start-up by every Python process of an SGLang server launched by rlhf_mc on a machine without a GPU
(this folder is put first on the server's PYTHONPATH; see rlhf_mc/rollout/cpu.py).

With the CUDA build of torch and no GPU:
- SGLang's release_memory_occupation calls `torch.get_device_module().synchronize()`, which is torch.cuda.synchronize
  and raises "Found no NVIDIA driver". On CPU there is nothing to wait for: a no-op.
- --enable-return-routed-experts (the routed experts of mixture-of-experts models, for routing replay) keeps them in a
  host buffer that SGLang pins with cudaHostRegister through torch.cuda.cudart() (mem_cache/pool_host/common.py),
  which raises the same error. On CPU there is nothing to pin: registering succeeds and does nothing.
"""

import torch


class _NoCudaRuntime:
    """torch.cuda.cudart() on CPU: host-memory registration only; any other runtime call fails as before."""

    @staticmethod
    def cudaHostRegister(ptr, size, flags):
        return 0

    @staticmethod
    def cudaHostUnregister(ptr):
        return 0

    @staticmethod
    def cudaGetErrorString(code):
        return f"cudaError {code} (rlhf_mc's CPU stand-in for the CUDA runtime)"


if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.cudart = lambda: _NoCudaRuntime
