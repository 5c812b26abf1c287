"""Shims that let Megatron-Core run on CPU (gloo), applied only when CUDA is absent.

Megatron-Core hard-codes CUDA in a few places that a CPU run reaches. Each shim below names the Megatron code it serves,
changes only that, and has a test (tests/test_cpu_shims.py) that shows the failure without it. With CUDA none of this
is applied.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
import warnings

import torch


def _rng_tracker() -> None:
    """megatron/core/tensor_parallel/random.py: CudaRNGStatesTracker.add/fork keep torch.cuda RNG states
    (`torch.cuda.get_rng_state()` -> "Found no NVIDIA driver"). On CPU the tracked streams are CPU generator states,
    forked the same way (swap in, run, swap back)."""
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mrandom.CudaRNGStatesTracker.add = add
    mrandom._get_cuda_rng_state = lambda *args, clone=False, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


class _NoOpStream:
    """A CUDA stream on CPU: work is already ordered, there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "_NoOpStream":
        return self  # an event on CPU: synchronize() has nothing to wait for


class _CpuDeviceTorch(types.ModuleType):
    """`torch` as seen by one Megatron module: tensor factories asked for device "cuda" get the CPU, and
    torch.cuda.current_device() names the CPU, torch.cuda.synchronize() has nothing to wait for, and the CUDA stream
    calls (Megatron-Core 0.19's grad sync waits on CUDA-graph events through torch.cuda.current_stream()) get a
    stream that does nothing. Everything else is the real torch."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")

    def __init__(self):
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(**{k: getattr(torch.cuda, k) for k in dir(torch.cuda)
                                             if not k.startswith("__")})
        self.cuda.current_device = lambda: torch.device("cpu")
        self.cuda.synchronize = lambda device=None: None
        stream = _NoOpStream()
        self.cuda.current_stream = lambda device=None: stream
        self.cuda.Stream = lambda *args, **kwargs: stream
        self.cuda.stream = lambda s=None: contextlib.nullcontext()
        for name in self._FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    @staticmethod
    def _on_cpu(factory):
        @functools.wraps(factory)
        def wrapper(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return wrapper

    def __getattr__(self, name):
        return getattr(torch, name)


# Megatron modules that create tensors with device="cuda" or torch.cuda.current_device() on the paths a CPU run
# reaches: the pipeline schedules (token counters) and their p2p layer (shapes of variable-length micro-batches),
# gradient clipping (norm buffers), the grad buffers of DDP,
# the distributed optimizer (shard buffers), the mixed-precision optimizer (found_inf / scale), RoPE (inv_freq), and
# distributed-checkpoint saving (a device-to-host synchronize, a validation flag all-reduced across ranks), and the
# grad-norm fallback used without apex/TE (megatron/core/utils.py: local_multi_tensor_l2_norm). In 0.19 the grad
# buffer also asks for CUDA streams (param_and_grad_buffer.py start_grad_sync). Mixture of experts: the router moves
# its weight to torch.cuda.current_device() in every forward (router.py gating), the tensor-parallel mappings give
# the experts' token gathers outputs there (mappings.py _gather_along_first_dim and friends), and the all-to-all
# token dispatcher makes a CUDA stream for its device-to-host copies (token_dispatcher.py cuda_dtoh_stream). YaRN
# (DeepSeek-V3's multi-latent attention) builds and moves its frequencies on torch.cuda.current_device().
# Sequence parallelism (TE's layers on GPU; on CPU models/head.py's test): the linear layers' backward all-gathers
# its input into a buffer there (layers.py).
_CUDA_DEVICE_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def _cuda_device_factories() -> None:
    """The modules in _CUDA_DEVICE_MODULES: `torch.zeros(..., device="cuda")` and friends raise without a GPU.
    Each of those modules gets a `torch` whose factories put "cuda" tensors on the CPU."""
    cpu_torch = _CpuDeviceTorch()
    for name in _CUDA_DEVICE_MODULES:
        importlib.import_module(name).torch = cpu_torch


@contextlib.contextmanager
def _cpu_tensors_typed_as_cuda():
    """Tensor.type() answers "torch.cuda.FloatTensor" for a CPU float32 tensor (and likewise for bf16/fp16)."""
    original = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _wrap_in_context(module_name: str, path: str, context) -> None:
    """Replaces the function or method at `module.path` by one that runs inside `context()`."""
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    raw = vars(owner)[name]
    descriptor = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if descriptor else raw

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        with context():
            return func(*args, **kwargs)

    setattr(owner, name, descriptor(wrapped) if descriptor else wrapped)


def _optimizer_param_type_checks() -> None:
    """megatron/core/optimizer/distrib_optimizer.py, optimizer.py and clip_grads.py accept only
    `param.type()` in {'torch.cuda.FloatTensor', 'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'} when building
    the main-parameter groups and when clipping, and raise (TypeError / AssertionError) for CPU tensors. Only inside
    those calls, CPU tensors report the CUDA type names."""
    for module_name, path in (
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
        ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
        ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),  # optimizer.py's imported name
    ):
        _wrap_in_context(module_name, path, _cpu_tensors_typed_as_cuda)


@contextlib.contextmanager
def _cuda_copy_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _tied_embedding_sync() -> None:
    """megatron/core/models/common/language_module/language_module.py: with tied embeddings and PP > 1,
    setup_embeddings_and_output_layer moves the shared weight with `weight.data.cuda()` before all-reducing it
    between the first and last stage. Only inside that call, `.cuda()` leaves CPU tensors where they are."""
    _wrap_in_context("megatron.core.models.common.language_module.language_module",
                     "LanguageModule.setup_embeddings_and_output_layer", _cuda_copy_is_identity)


def _rope_cp_slice() -> None:
    """megatron/core/models/common/embeddings/rope_utils.py: get_pos_emb_on_this_cp_rank builds its chunk index with
    `torch.tensor(..., pin_memory=True).cuda()` (pinning needs CUDA). Same selection on CPU: the positions this CP
    rank holds (runtime/context_parallel.py), taken from the rotary table; patched where rotary_pos_embedding.py
    imported it."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    from rlhf_mc.runtime.context_parallel import cp_positions

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        index = cp_positions(pos_emb.size(seq_dim), cp_group.size(), cp_group.rank(), pos_emb.device)
        return pos_emb.index_select(seq_dim, index)

    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def _moe_split_sizes_on_host() -> None:
    """megatron/core/transformer/moe/token_dispatcher.py (MoEAlltoAllTokenDispatcher.preprocess): the all-to-all's
    split sizes go to the host through moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True), which converts only
    CUDA tensors: a CPU tensor comes back as a tensor, and torch.distributed.all_to_all_single refuses tensors as
    split sizes (TypeError: incompatible function arguments, in tensor_parallel/mappings.py _AllToAll.forward). On
    CPU the same conversion: the numpy array of the tensor. Patched where token_dispatcher imported it."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


SHIMS = {
    "rng_tracker": _rng_tracker,
    "cuda_device_factories": _cuda_device_factories,
    "optimizer_param_type_checks": _optimizer_param_type_checks,
    "rope_cp_slice": _rope_cp_slice,
    "tied_embedding_sync": _tied_embedding_sync,
    "moe_split_sizes_on_host": _moe_split_sizes_on_host,
}
_applied: set[str] = set()


def apply_megatron_shims(skip: tuple[str, ...] = ()) -> None:
    """Applies every shim not in `skip` (tests skip one to show what it fixes). A no-op with CUDA."""
    if torch.cuda.is_available():
        return
    unknown = set(skip) - set(SHIMS)
    if unknown:
        raise ValueError(f"skip: unknown shim(s) {sorted(unknown)}; known: {sorted(SHIMS)}")
    # Expected on CPU, printed once per process and module otherwise.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(are|is) not installed")
    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS")
    for name, shim in SHIMS.items():
        if name not in skip and name not in _applied:
            shim()
            _applied.add(name)
