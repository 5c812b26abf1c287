"""Imported at start-up by every Python process of an SGLang server launched by rlhf_mc on a machine without a GPU
(this folder is put first on the server's PYTHONPATH; see rlhf_mc/rollout/cpu.py).

With the CUDA build of torch and no GPU, SGLang's release_memory_occupation calls
`torch.get_device_module().synchronize()`, which is torch.cuda.synchronize and raises "Found no NVIDIA driver".
On CPU there is nothing to wait for: make it a no-op.
"""

import torch

if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda device=None: None
