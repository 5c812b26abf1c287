"""Imported at start-up by every Python process of an SGLang server launched by rlhf_mc on a machine without a GPU
(this folder is put first on the server's PYTHONPATH; see rlhf_mc/rollout/cpu.py).

With the CUDA build of torch and no GPU:
- SGLang's release_memory_occupation calls `torch.get_device_module().synchronize()`, which is torch.cuda.synchronize
  and raises "Found no NVIDIA driver". On CPU there is nothing to wait for: a no-op.
- --enable-return-routed-experts (the routed experts of mixture-of-experts models, for routing replay) keeps them in a
  host buffer that SGLang pins with cudaHostRegister through torch.cuda.cudart() (mem_cache/pool_host/common.py),
  which raises the same error. On CPU there is nothing to pin: registering succeeds and does nothing.
- Multi-latent attention (DeepSeek-V3) on the torch_native backend: SGLang registers no MLA handler for it
  (models/deepseek_common/attention_backend_handler.py), so triton's sends a prefill without a cached prefix to the
  non-absorbed path (forward_normal), whose K/V torch_native's forward_extend reads back from the KV cache - which for
  MLA holds the latent, not per-head keys ("Expected size ... [4, 24] but got: [4, 40]"). The absorbed path reads
  exactly that cache (SGLang takes it for decode already): torch_native gets the dispatch that, without AMX, always
  chooses it. Patched right after SGLang imports that module (this file does not import SGLang).
- torch_native attends one request at a time (a KV gather and an SDPA call per running request, per layer and decode
  step): its two per-request methods are replaced by batched ones (rlhf_mc/rollout/cpu_attention.py).
- A weight payload is a shared-memory file, which the server maps when it opens the payload and unmaps when the
  load is done, so every load pages the whole bucket in anew: a weight sync's loads took ~2x a copy of their bytes
  (476 MB: ~58 ms against ~29). A payload marked KEEP_MAPPED (rlhf_mc/rollout/cpu.py: its buffer is a staging that
  carries every bucket of every sync) is kept open until the next marked one, and torch reopens a file it holds
  open without mapping it again (476 MB: ~36 ms a load). It costs no memory: the pages are the sender's staging.
- Plain sampling draws an exponential per vocabulary entry on one core (10 ms per decode step of 256 requests over
  2048 tokens): unseeded draws use the inverse CDF instead (rlhf_mc/rollout/cpu_sampling.py).
- SGLang starts its scheduler and detokenizer processes with multiprocessing's "spawn" (for CUDA, which a forked
  child cannot initialize), so each imports SGLang and torch again. In a TP=1 server (RLHF_MC_FORK_SCHEDULER, set by
  rlhf_mc/rollout/cpu.py) they are forked instead and start with the server's modules (and the patches above)
  imported: a start took 23-39 s against 44-46 s. The server process has run no torch kernel before it starts them.
- LoRA serving (--lora-backend torch_native, plain torch) pins its host-side index tensors, with Tensor.pin_memory()
  (sglang/srt/lora/layers.py, lora/backend/torch_backend.py) and pin_memory=True in tensor factories, which raises
  the same error: pinning is a no-op, and those two modules get tensor factories that ignore pin_memory. (The
  default backend, csgmv, is triton kernels: GPU only.)
"""

import importlib.abc
import importlib.machinery
import multiprocessing
import os
import sys

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
    # LoRA serving (sglang/srt/lora/...) pins its host-side index tensors; pinning needs the CUDA driver and
    # raises "Found no NVIDIA driver". On CPU there is nothing to pin: a no-op (the tensor itself).
    torch.Tensor.pin_memory = lambda self, device=None: self


class _UnpinnedTorch:
    """`torch` as a module's global, whose tensor factories ignore pin_memory=True (which raises without CUDA)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _unpinned(factory):
        def call(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)

        call.__name__ = factory.__name__
        return call

    def __init__(self):
        for name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
            setattr(self, name, self._unpinned(getattr(torch, name)))


def _unpinned_lora(module) -> None:
    if module.torch is not torch:
        raise AttributeError(name="torch")
    module.torch = _UnpinnedTorch()


def _absorbed_mla_on_torch_native(handlers) -> None:
    handlers.AttentionBackendRegistry.register("torch_native", handlers._dispatch_mla_subtype)


def _batched_torch_native_attention(backend) -> None:
    from rlhf_mc.rollout import cpu_attention

    cpu_attention.install(backend.TorchNativeAttnBackend)


def _inverse_cdf_sampling(sampler) -> None:
    from rlhf_mc.rollout import cpu_sampling

    cpu_sampling.install(sampler)


def _staging_stays_mapped(tp_worker) -> None:
    from rlhf_mc.rollout.cpu import KEEP_MAPPED

    deserialize = tp_worker.BaseTpWorker.deserialize_own_rank
    kept = []

    def deserialize_own_rank(self, serialized_named_tensors):
        payload = deserialize(self, serialized_named_tensors)
        if isinstance(payload, dict) and payload.pop(KEEP_MAPPED, False):
            kept[:] = [payload["flattened_tensor"]]
        return payload

    tp_worker.BaseTpWorker.deserialize_own_rank = deserialize_own_rank


# the release whose code these patches replace; any other is refused at the server's start, before it loads a model
SGLANG_VERSION = "0.5.23"

_PATCHES = {"sglang.srt.managers.tp_worker": _staging_stays_mapped,
            "sglang.srt.models.deepseek_common.attention_backend_handler": _absorbed_mla_on_torch_native,
            "sglang.srt.layers.attention.torch_native_backend": _batched_torch_native_attention,
            "sglang.srt.layers.sampler": _inverse_cdf_sampling,
            # LoRA serving with --lora-backend torch_native
            "sglang.srt.lora.layers": _unpinned_lora,
            "sglang.srt.lora.backend.torch_backend": _unpinned_lora}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module is first imported (then steps aside)."""

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.pop(name, None)
        if patch is None:
            return None
        if not _PATCHES:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                try:
                    patch(module)
                except AttributeError as error:  # a release whose code moved: fail loudly, not serve unpatched
                    raise RuntimeError(f"rlhf_mc's CPU patch {patch.__name__} of {name} found no {error.name!r} "
                                       f"(written for sglang {SGLANG_VERSION})") from error

            spec.loader.exec_module = exec_and_patch
        return spec


def _fork_instead_of_spawn() -> None:
    set_start_method = multiprocessing.set_start_method

    def set_fork_for_spawn(method, force=False):
        set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = set_fork_for_spawn


def _check_sglang_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        return  # not an SGLang process's environment (this folder is on the server's PYTHONPATH only)
    if found != SGLANG_VERSION:
        raise RuntimeError(f"sglang {found}: rlhf_mc's CPU patches (rlhf_mc/rollout/cpu_site) are written for sglang "
                           f"{SGLANG_VERSION}; install that release (tools/setup_env.sh)")


if not torch.cuda.is_available():
    _check_sglang_version()
    # SGLang's debug dumper imports megatron.core at import time when it is installed, for a plugin the server never
    # uses: 3-4 s of every server start on 2 cores (measured). Nothing else in the server imports it.
    sys.modules.setdefault("megatron", None)
    sys.meta_path.insert(0, _PatchAfterImport())
    from rlhf_mc.rollout.cpu import FORK_SCHEDULER

    if os.environ.get(FORK_SCHEDULER) == "1":
        _fork_instead_of_spawn()
