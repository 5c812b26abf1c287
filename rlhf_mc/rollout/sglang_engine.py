"""RolloutEngine on SGLang: data-parallel servers launched and supervised here (or attached by address), samples
from token ids dealt to the engines on the client (by session, else to the least loaded) in batched requests, weight
updates through SGLang's APIs.

Weight updates: "tensor" payloads are flattened buckets (SGLang's `flattened_bucket` load format: one tensor, one
handle per bucket), serialized once per engine TP rank, as SGLang's own sender does (each rank opens only its own
payload; on GPU with SGLang's device-UUID reduction, so a rank with another CUDA_VISIBLE_DEVICES can open it). Each
bucket's load labels the engine's weights (SGLang records the label with the load, and only if it succeeded): the
buckets before the last INCONSISTENT_VERSION, the last one the new version, which also flushes the prefix cache the
old weights made. So a half-updated engine never claims a version (a load that fails records nothing, and its engine
is restarted before it serves again), and an update takes no calls beyond pause, begin, one load per bucket, end and
resume (~2 ms each on CPU).

Failure handling:
- a request that fails because its server died restarts that server (up to rollout.max_restarts) and is retried;
  `on_restart(engine)` runs after the restart and before any retry (the trainer gives the engine its current
  weights there);
- a restarted server comes back with its launch weights plus the last update from disk: its weight version says so;
- a failed weight update restarts a dead server before raising, so no dead engine is left behind;
- a control call (pause, flush, release, resume) that finds its launched server dead restarts it and is retried.
sglang-router is not used (not installed here); balancing is least-requests-in-flight on the client.
"""

from __future__ import annotations

import atexit
import base64
import collections
import contextlib
import datetime
import json
import logging
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Sequence

import dataclasses

import numpy as np
import requests
import torch
import torch.distributed as dist

from rlhf_mc.config import ConfigError, RolloutConfig
from rlhf_mc.rollout import cpu
from rlhf_mc.rollout.base import RolloutSample, SamplingParams
from rlhf_mc.rollout.sglang_server import LORA_NAME, ServerProcess
from rlhf_mc.runtime import host
from rlhf_mc.runtime.spawn import free_port

log = logging.getLogger(__name__)
LAUNCH_VERSION = -1  # the weights a server was launched with
INCONSISTENT_VERSION = -2  # an update under way, or one that failed half-way
# SGLang's memory tags (sglang/srt/constants.py): the weights come back before a sync, the KV cache (and CUDA graphs)
# after it, so the two are never on the device together with the trainer's state.
WEIGHTS_TAGS = ("weights",)
KV_CACHE_TAGS = ("kv_cache", "cuda_graph")


class WeightUpdateError(RuntimeError):
    pass


class EngineDown(RuntimeError):
    pass


class ServerError(RuntimeError):
    """A server that answers its health check failed a request (HTTP 5xx)."""


def _version(text: str | None) -> int:
    return int(text) if text is not None and text.lstrip("-").isdigit() else LAUNCH_VERSION


def _token_versions(meta: dict, tokens: int) -> list[int]:
    """The version of each output token, from SGLang's meta_info["weight_versions"]: spans {version, start, end}
    over the output, one more at every weight update the request lived through (utils/weight_versions.py)."""
    versions = [LAUNCH_VERSION] * tokens
    for span in meta["weight_versions"]:
        versions[span["start"]:span["end"]] = [_version(span["version"])] * (span["end"] - span["start"])
    return versions


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One sample to generate: its prompt, its SGLang sampling params, and whether the context cut its budget."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    sampling: dict
    capped: bool  # max_new_tokens lowered to what the context leaves


@dataclasses.dataclass
class TensorPayload:
    """One engine TP rank's share of a bucket: `serialized` for /update_weights_from_tensor, and the flattened
    tensor it refers to, which must stay alive until the engine has loaded it."""

    serialized: str
    tensor: torch.Tensor


def _routed_experts(meta: dict, tokens: int, url: str) -> torch.Tensor:
    """SGLang's meta_info["routed_experts"]: base64 of int32 [tokens, layers, top-k] (the prompt and the response
    but the last token), as int16 [tokens, layers * top-k]."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise ConfigError(f"rollout.engine.addresses: {url} returned no routed experts; a mixture-of-experts model's "
                          "servers need --enable-return-routed-experts")
    ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    return torch.from_numpy(ids.astype(np.int16)).reshape(tokens, -1)


def flat_layout(shapes: list[tuple[str, torch.Size, torch.dtype]]) -> tuple[list, int]:
    """SGLang's FlattenedTensorBucket layout of tensors of these (name, shape, dtype): their FlattenedTensorMetadata
    and the bytes of the whole. Tensors are laid out by element size, largest first, so every tensor starts at an
    offset its dtype can be viewed at."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metadata, offset = [], 0
    for name, shape, dtype in sorted(shapes, key=lambda item: -item[2].itemsize):
        size = shape.numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, shape, dtype, offset, offset + size, size))
        offset += size
    return metadata, offset


def flat_views(flat: torch.Tensor, metadata: list) -> dict[str, torch.Tensor]:
    """Name -> the tensor at its place in a flattened bucket (a view of `flat`)."""
    return {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape) for m in metadata}


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]], staging: torch.Tensor | None = None):
    """A bucket as SGLang's FlattenedTensorBucket (flat_layout): one byte tensor (never the model's own storage)
    and its metadata. `staging`: a byte tensor to lay the bucket out in (shared_staging); else a new one."""
    metadata, nbytes = flat_layout([(name, t.shape, t.dtype) for name, t in named_tensors])
    if staging is None:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=named_tensors[0][1].device)
    elif staging.numel() < nbytes:
        raise ValueError(f"flatten_bucket: a {nbytes}-byte bucket does not fit the {staging.numel()}-byte staging")
    else:
        flat = staging[:nbytes]
    views = flat_views(flat, metadata)
    for name, t in named_tensors:
        views[name].copy_(t.detach())
    return flat, metadata


def serialize_flat(flat: torch.Tensor, metadata: list, staging: bool = False) -> str:
    """The /update_weights_from_tensor payload of a flattened bucket, by reference: a CUDA IPC handle named by
    device UUID on GPU, a shared-memory file on CPU. `staging`: `flat` lies in a buffer that carries every bucket
    (shared_staging); on CPU the payload says so (KEEP_MAPPED), and the server keeps it mapped after the load."""
    from sglang.srt.utils import MultiprocessingSerializer

    payload = {"flattened_tensor": flat, "metadata": metadata}
    if cpu.on_cpu():
        cpu.prepare_tensor_sender()
        if staging:
            payload[cpu.KEEP_MAPPED] = True
    else:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize(payload, output_str=True)


def tensor_payload(named_tensors: list[tuple[str, torch.Tensor]], staging: torch.Tensor | None = None
                   ) -> TensorPayload:
    """A bucket flattened (flatten_bucket, into `staging` if given) and serialized by reference (serialize_flat)."""
    flat, metadata = flatten_bucket(named_tensors, staging)
    return TensorPayload(serialize_flat(flat, metadata, staging is not None), flat)


def shared_staging(nbytes: int) -> torch.Tensor:
    """A CPU byte tensor in shared memory for tensor_payload. Serializing a tensor that is not shared yet creates a
    new shared-memory file and copies the tensor into it (torch's file_system sharing), whose fresh pages fault in
    on the copy: per 256 MB bucket ~4x a plain copy. A staging buffer shared once is serialized by its file name."""
    cpu.prepare_tensor_sender()
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def unlink_staging(staging: torch.Tensor) -> None:
    """Removes a shared_staging buffer's file from /dev/shm, ahead of its process's kill. Torch removes it when the last
    process mapping it lets go, or after a crash through its shm manager; Ray kills a run's workers and the shm manager
    (their child) with them, and the engines keep theirs open: without this each run left its staging (two buckets)
    in /dev/shm, that is in memory, until the machine restarted. The caller keeps the staging: once the file is gone,
    torch's own removal at the last let-go finds nothing and aborts the process."""
    _, name, _ = staging.untyped_storage()._share_filename_cpu_()  # the existing file's name
    Path("/dev/shm", name.decode().lstrip("/")).unlink(missing_ok=True)


class SGLangEngine:
    def __init__(self, cfg: RolloutConfig, log_dir: str | Path | None = None, memory_saver: bool = False,
                 first_slot: int = 0, slots_on_host: int | None = None):
        """`memory_saver`: launch with SGLang's memory saver (GPU), so release_memory frees device memory: for
        engines that share their devices with the trainer. On CPU the servers' TP ranks take device slots
        `first_slot`, `first_slot` + 1, ... of the `slots_on_host` on this machine, each slot an equal share of its
        cores (default: num_engines x tp slots, the machine to these servers alone)."""
        if not cfg.addresses and not cfg.model_path:
            raise ConfigError("rollout.model_path: required unless rollout.addresses attaches to running servers")
        self.cfg = cfg
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="rlhf_mc_sglang_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[ServerProcess | None] = []
        if cfg.addresses:
            self.urls = [f"http://{address}" for address in cfg.addresses]
            self.servers = [None] * len(self.urls)
        else:
            for i in range(cfg.num_engines):
                port = cfg.base_port + i if cfg.base_port else free_port()
                slots = range(first_slot + i * cfg.tp, first_slot + (i + 1) * cfg.tp)
                self.servers.append(ServerProcess(i, cfg, port, self.log_dir, memory_saver, slots,
                                                  slots_on_host or cfg.num_engines * cfg.tp))
            self.urls = [s.url for s in self.servers]
        self.versions = [LAUNCH_VERSION] * len(self.urls)  # weight version each engine holds
        self.released: list[set[str]] = [set() for _ in self.urls]  # memory tags each engine has released
        self.on_restart: Callable[[int], None] | None = None  # runs after a restart, before requests are retried
        self.stats: collections.Counter = collections.Counter()
        self._disk_weights: tuple[str, int] | None = None  # last update from disk, re-applied after a restart
        self._weight_group: tuple[str, object] | None = None  # (name, process group): connect_weight_group
        self._aborted_groups: list = []  # kept: a gloo group is freed only once its pending broadcast times out
        self._inflight = [0] * len(self.urls)
        self._restarts = [0] * len(self.urls)
        self._restart_locks = [threading.Lock() for _ in self.urls]
        self._lock = threading.Condition()  # guards _inflight; notified when a request ends
        self._session = requests.Session()
        self._session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=cfg.max_concurrency + 8))
        self._closed = False
        atexit.register(self.shutdown)
        try:
            for server in self.servers:
                if server is not None:
                    server.start()
            for server in self.servers:
                if server is not None:
                    server.wait_ready(cfg.startup_timeout_s)
            # SGLang 0.5.23 (managers/tp_worker.py, scheduler.py): max_req_len = context_len - 1, prompts must be
            # shorter than max_req_input_len = max_req_len - 5, and a response ends at max_req_len - 1 tokens in all.
            infos = [self._call(e, "GET", "/get_server_info", None, timeout=30) for e in range(len(self.urls))]
            self.engine_tp = [info["tp_size"] for info in infos]  # attached servers may differ from cfg.tp
            self.deterministic = all(info["enable_deterministic_inference"] for info in infos)
            max_input = min(info["max_req_input_len"] for info in infos)
            self.max_prompt_length = max_input - 1
            self.max_sequence_length = max_input + 4  # prompt + response
        except BaseException:
            self.shutdown()
            raise

    # ---------------------------------------------------------------- requests

    def _call(self, engine: int, method: str, path: str, payload: dict | None, timeout: float | None = None):
        response = self._session.request(method, self.urls[engine] + path, json=payload,
                                         timeout=timeout or self.cfg.request_timeout_s)
        try:
            body = response.json() if response.content else {}
        except ValueError:  # some routes (/flush_cache) answer in plain text
            body = {"text": response.text}
        if response.status_code >= 500:
            # a dead or hung server's proxy error is recovered from (a restart); a live server's own failure is not:
            # restarting it would lose its state and ask the same again
            if self._healthy(engine):
                raise ServerError(f"engine {engine} {path}: HTTP {response.status_code} from a live server (not "
                                  f"restarted): {json.dumps(body)[:500]}")
            raise requests.ConnectionError(f"engine {engine} {path}: HTTP {response.status_code}: {body}")
        if response.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
            raise RuntimeError(f"engine {engine} {path}: HTTP {response.status_code}: {json.dumps(body)[:500]}")
        return body

    def _pick_engine(self, avoid: int | None, preferred: int, samples: int) -> int:
        """`preferred`, unless it is the engine to avoid (the one that just failed), else the least loaded other."""
        with self._lock:
            engine = preferred
            if engine == avoid and len(self.urls) > 1:
                engine = min((i for i in range(len(self.urls)) if i != avoid), key=lambda i: self._inflight[i])
            self._inflight[engine] += samples
            return engine

    def _generate_request(self, payload: dict, engine: int) -> tuple[int, list]:
        """Posts one batched /generate request to `engine`; a server that died is restarted and the request retried
        (on another engine, if there is one). Returns the engine that answered and one output per input."""
        avoid, samples = None, len(payload["input_ids"])
        for _ in range(self.cfg.max_restarts + 2):
            target = self._pick_engine(avoid, engine, samples)
            try:
                return target, self._call(target, "POST", "/generate", payload)
            except (requests.ConnectionError, requests.Timeout) as error:
                self.stats["request_retries"] += 1
                log.warning("engine %d failed a request (%s); recovering", target, error)
                self.recover(target)
                avoid = target
            finally:
                with self._lock:
                    self._inflight[target] -= samples
                    self._lock.notify_all()
        raise EngineDown(f"request failed {self.cfg.max_restarts + 2} times")

    def _healthy(self, engine: int) -> bool:
        server = self.servers[engine]
        if server is not None and not server.alive():
            return False
        try:
            return self._session.get(self.urls[engine] + "/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def recover(self, engine: int, force: bool = False) -> None:
        """Restarts a launched server that is dead or unresponsive (or, with `force`, whose weights are in an
        unknown state after a failed update); re-applies the last weights from disk."""
        with self._restart_locks[engine]:
            if not force and self._healthy(engine):
                return
            server = self.servers[engine]
            if server is None:
                self.versions[engine] = INCONSISTENT_VERSION
                raise EngineDown(f"attached engine {self.urls[engine]} needs a restart, but it was not launched "
                                 "here")
            if self._restarts[engine] >= self.cfg.max_restarts:
                raise EngineDown(f"engine {engine} needs restart {self._restarts[engine] + 1} > rollout.max_restarts"
                                 f"={self.cfg.max_restarts}; log tail:\n{server.log_tail()}")
            self._restarts[engine] += 1
            self.stats["engine_restarts"] += 1
            log.warning("restarting SGLang engine %d (restart %d)", engine, self._restarts[engine])
            released, self.released[engine] = self.released[engine], set()
            server.stop()
            server.start()
            server.wait_ready(self.cfg.startup_timeout_s)
            self.versions[engine] = LAUNCH_VERSION
            if self._disk_weights is not None:
                path, version = self._disk_weights
                self._call(engine, "POST", "/update_weights_from_disk",
                           {"model_path": path, "weight_version": str(version)})
                self.versions[engine] = version
            if released:  # given back to a colocated trainer: a new server holds it all, until it gives it back
                self._call(engine, "POST", "/release_memory_occupation", {"tags": sorted(released)})
                self.released[engine] = released
            if self.on_restart is not None:
                self.on_restart(engine)

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, sessions: list[int] | None = None,
                 max_new_tokens: list[int] | None = None) -> list[RolloutSample]:
        if sampling.seed is not None and not self.deterministic:
            raise ValueError("sampling.seed: SGLang honours per-sample seeds only on servers started with "
                             "--enable-deterministic-inference (rollout.engine.deterministic=true; GPU attention "
                             "backends)")
        params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                  "stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": sampling.ignore_eos,
                  "skip_special_tokens": False}
        samples: list[RolloutSample] = []
        # One entry per sample, n=1 each: SGLang serves a request with n > 1 as a prefix-caching request it waits
        # for, then the n samples (tokenizer_manager _handle_batch_request, which advises duplicating the prompts
        # instead), and a whole rollout's samples in one batched request reach its scheduler in one message, so
        # they start in one prefill. verl's SGLang rollout sends its batch so, prompts repeated n times.
        shares: list[list[_Entry]] = [[] for _ in self.urls]
        with self._lock:
            load = list(self._inflight)
        for p, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{p}]: empty prompt")
            budget = self.max_sequence_length - len(prompt)
            if len(prompt) > self.max_prompt_length:  # the server refuses it: reported and counted, never cut
                self.stats["prompt_over_context"] += 1
                samples += [RolloutSample(p, i, [], [], "context_length", []) for i in range(sampling.n)]
                continue
            wanted = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens[p]
            if wanted < 1:
                raise ValueError(f"max_new_tokens[{p}]: must be >= 1, got {wanted}")
            max_new = min(wanted, budget)
            # a session's prompts go to its engine (whose cache holds the conversation), others to the least loaded
            engine = sessions[p] % len(self.urls) if sessions is not None else min(
                range(len(self.urls)), key=lambda e: load[e])
            load[engine] += sampling.n
            for i in range(sampling.n):
                sp = {**params, "max_new_tokens": max_new}
                if sampling.seed is not None:
                    sp["sampling_seed"] = sampling.seed + i
                shares[engine].append(_Entry(p, i, prompt, sp, max_new < wanted))

        def serve(engine: int) -> list[RolloutSample]:
            """The engine's share in requests of at most rollout.max_concurrency samples, one after another."""
            served = []
            for first in range(0, len(shares[engine]), self.cfg.max_concurrency):
                batch = shares[engine][first:first + self.cfg.max_concurrency]
                request = {"input_ids": [entry.prompt for entry in batch],
                           "sampling_params": [entry.sampling for entry in batch], "return_logprob": True}
                if self.cfg.return_routed_experts:
                    request["return_routed_experts"] = True
                if self.cfg.lora_adapter:
                    request["lora_path"] = LORA_NAME
                answered_by, outputs = self._generate_request(request, engine)
                served += [self._sample(entry, answered_by, out) for entry, out in zip(batch, outputs, strict=True)]
            return served

        busy = [engine for engine, share in enumerate(shares) if share]
        with ThreadPoolExecutor(max_workers=max(1, len(busy))) as pool:
            for served in pool.map(serve, busy):
                samples += served
        samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return samples

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """Prefill only: each sequence's log-probs of its tokens from `starts[i]` on (token t given the tokens before
        it), under the served model's softmax of its raw logits (SGLang's input log-probs are never
        temperature-scaled). Nothing is generated (max_new_tokens 0); the sequences are dealt to the engines in
        one request each (of at most max_concurrency), a dead server's restarted and retried as generate's are."""
        for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
            if not 1 <= start < len(seq):
                raise ValueError(f"starts[{i}]: {start} must lie in [1, {len(seq)}) (a token's log-prob needs the "
                                 "tokens before it)")
            if len(seq) > self.max_sequence_length:
                raise ValueError(f"sequences[{i}]: {len(seq)} tokens, more than the engine holds "
                                 f"({self.max_sequence_length})")
        # as many requests as engines (at most max_concurrency sequences each), served at once
        size = min(self.cfg.max_concurrency, max(1, -(-len(sequences) // len(self.urls))))
        chunks = [range(first, min(first + size, len(sequences))) for first in range(0, len(sequences), size)]

        def serve(k: int) -> list[list[float]]:
            rows = chunks[k]
            request = {"input_ids": [sequences[i] for i in rows],
                       "sampling_params": [{"max_new_tokens": 0, "temperature": 0.0}] * len(rows),
                       "return_logprob": True, "logprob_start_len": [starts[i] - 1 for i in rows]}
            if self.cfg.lora_adapter:
                request["lora_path"] = LORA_NAME
            _, outputs = self._generate_request(request, k % len(self.urls))
            # input_token_logprobs[j] is about token logprob_start_len + j, (log-prob, token id, text), the first
            # one None (measured on 0.5.23: SGLang computes none for the token at logprob_start_len)
            return [[logprob for logprob, *_ in out["meta_info"]["input_token_logprobs"][1:]]
                    for out in outputs]

        with ThreadPoolExecutor(max_workers=max(1, min(len(chunks), len(self.urls)))) as pool:
            return [row for rows in pool.map(serve, range(len(chunks))) for row in rows]

    def _sample(self, entry: _Entry, engine: int, out: dict) -> RolloutSample:
        meta = out["meta_info"]
        reason = meta["finish_reason"]["type"] if meta.get("finish_reason") else "abort"
        if reason == "length" and entry.capped:  # stopped by the context limit, not by max_new_tokens
            reason = "context_length"
            self.stats["response_over_context"] += 1
        logprobs = [logprob for logprob, *_ in meta["output_token_logprobs"]]
        routed = None
        if self.cfg.return_routed_experts:
            routed = _routed_experts(meta, len(entry.prompt) + len(out["output_ids"]) - 1, self.urls[engine])
        return RolloutSample(entry.prompt_index, entry.sample_index, list(out["output_ids"]), logprobs, reason,
                             _token_versions(meta, len(out["output_ids"])), engine, routed)

    # ---------------------------------------------------------------- weights

    @property
    def weight_version(self) -> int:
        return min(self.versions)

    def _update_all(self, send: Callable[[], None], version: int, what: str) -> None:
        """Runs `send` (which updates every engine); on any failure restarts every engine, so none is left dead
        or with half-updated weights, and raises."""
        try:
            send()
        except Exception as error:
            for engine in range(len(self.urls)):
                self.recover(engine, force=True)
            raise WeightUpdateError(f"weight update {what} to version {version} failed ({error}); engines restarted,"
                                    f" versions now {self.versions}") from error
        self.versions = [version] * len(self.urls)

    def begin_weight_update(self, engine: int) -> None:
        """Opens a weight-update session on one engine; its loads label it (_bucket_labels), end_weight_update
        closes it. Until then its version reads INCONSISTENT_VERSION here."""
        self._call(engine, "POST", "/begin_weight_update", {})
        self.versions[engine] = INCONSISTENT_VERSION

    @staticmethod
    def _bucket_labels(version: int, last: bool) -> dict:
        """What a bucket's load records with it (module docstring): the last bucket labels the engine `version` and
        flushes the old weights' prefix cache, the others label it INCONSISTENT_VERSION."""
        return {"weight_version": str(version if last else INCONSISTENT_VERSION), "flush_cache": last}

    def load_tensor_payloads(self, engine: int, payloads: list[str], version: int, last: bool) -> None:
        """One bucket into one engine: `payloads[i]` (tensor_payload(...).serialized) is what its TP rank i opens;
        `last`: the update's last bucket, which labels the engine `version`."""
        if len(payloads) != self.engine_tp[engine]:
            raise ValueError(f"engine {engine} has {self.engine_tp[engine]} TP ranks, got {len(payloads)} payloads")
        self._call(engine, "POST", "/update_weights_from_tensor",
                   {"serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                    **self._bucket_labels(version, last)})

    def load_adapter(self, engine: int, config: dict, payloads: list[str], version: int) -> None:
        """Replaces the engine's LoRA adapter (LORA_NAME) with the one in `payloads` (one serialized {PEFT name:
        tensor} per TP rank; `config`: its adapter_config.json) and labels the engine `version`. The base weights
        stay. SGLang refuses to load a name that is loaded: the old one goes first (its prefix cache with it: a
        loaded adapter has an id of its own)."""
        if len(payloads) != self.engine_tp[engine]:
            raise ValueError(f"engine {engine} has {self.engine_tp[engine]} TP ranks, got {len(payloads)} payloads")
        self._call(engine, "POST", "/unload_lora_adapter", {"lora_name": LORA_NAME})
        self.versions[engine] = INCONSISTENT_VERSION
        self._call(engine, "POST", "/load_lora_adapter_from_tensors",
                   {"lora_name": LORA_NAME, "config_dict": config, "serialized_named_tensors": payloads})
        self._call(engine, "POST", "/update_weight_version", {"new_version": str(version),
                                                              "abort_all_requests": False})
        self.versions[engine] = version

    def end_weight_update(self, engine: int, version: int) -> None:
        """Closes the session; the engine holds `version`, which its last bucket labelled it with."""
        self._call(engine, "POST", "/end_weight_update", {})
        self.versions[engine] = version

    def update_weights_from_tensors(self, buckets: Sequence[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """In-process sender: HF-named tensors of this process handed to every engine by reference (CUDA IPC on GPU,
        shared files on CPU), bucket by bucket, one payload per engine TP rank. One bucket is alive at a time. (The
        trainer's colocated sync sends each engine rank's payload from the trainer rank on its device instead:
        sync/transports.py.)"""
        engines = range(len(self.urls))

        def send() -> None:
            for engine in engines:
                self.begin_weight_update(engine)
            for b, bucket in enumerate(buckets):
                for engine in engines:
                    payloads = [tensor_payload(bucket) for _ in range(self.engine_tp[engine])]
                    self.load_tensor_payloads(engine, [p.serialized for p in payloads], version,
                                              last=b == len(buckets) - 1)
            for engine in engines:
                self.end_weight_update(engine, version)

        self._update_all(send, version, "from tensors")

    def connect_weight_group(self, master_address: str, master_port: int, backend: str = "gloo",
                             group_name: str = "rlhf_mc_weights"):
        """Disaggregated: a process group between the caller (rank 0) and every engine rank (ranks 1..), for
        update_weights_from_distributed, formed once every engine has joined it; the previous group, if any, is left
        first on both sides. Returns the caller's group."""
        from sglang.srt.utils import init_custom_process_group

        self.leave_weight_group()
        world_size = 1 + sum(self.engine_tp)
        threads = []
        for engine in range(len(self.urls)):
            payload = {"master_address": master_address, "master_port": master_port,
                       "rank_offset": 1 + sum(self.engine_tp[:engine]), "world_size": world_size,
                       "group_name": group_name, "backend": backend}
            threads.append(self._in_thread(
                lambda e=engine, p=payload: self._call(e, "POST", "/init_weights_update_group", p)))
        # Longer than a broadcast may take (_broadcast's deadline), so that the group is aborted by us, not by NCCL's
        # watchdog, whose default on error ends the process; errors it finds only clean the group up.
        timeout = datetime.timedelta(seconds=self.cfg.request_timeout_s + 60)
        with host.environ(TORCH_NCCL_ASYNC_ERROR_HANDLING="2", TORCH_NCCL_DUMP_ON_TIMEOUT="0"):
            group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                              world_size=world_size, rank=0, group_name=group_name, timeout=timeout)
        for thread in threads:
            thread.join_or_raise()
        self._weight_group = (group_name, group)
        return group

    def leave_weight_group(self) -> None:
        """Every engine and this process leave the weight group (SGLang keeps each group an engine joined, and its
        communicator, until told): before another is formed. An engine restarted since never had it (its refusal is
        ignored)."""
        if self._weight_group is None:
            return
        name, group = self._weight_group
        for engine in range(len(self.urls)):
            with contextlib.suppress(requests.RequestException, RuntimeError):
                self._call(engine, "POST", "/destroy_weights_update_group", {"group_name": name})
        dist.destroy_process_group(group)
        self._weight_group = None

    def _abort_weight_group(self) -> None:
        """After a failed broadcast: NCCL's communicator aborted, which ends the collective this GPU's stream waits
        on; a gloo group's pending broadcast ends at the group's timeout, in its own thread. Either way the group is
        not used again, and the engines are restarted (_update_all): what survives is this process, its other
        groups (the trainer's own), its CUDA context and its training state."""
        _, group = self._weight_group
        if dist.get_backend(group) == "nccl":
            dist.distributed_c10d._abort_process_group(group)
        self._aborted_groups.append(group)
        self._weight_group = None

    def _broadcast(self, flat: torch.Tensor, receivers: list["_Call"]) -> None:
        """Rank 0's side of one bucket's broadcast, which every engine joins in its `receivers` call. An engine that
        refuses the bucket answers at once without joining (a group it does not have, no open session, a bad layout:
        SGLang checks these before it receives); one that dies never joins. The collective then never completes: on
        NCCL a plain broadcast would leave this GPU's stream waiting on it until the watchdog ended the process, on
        gloo it fails at the group's timeout. So the broadcast runs asynchronously and is watched: a receiver's
        error, or the request timeout, aborts the group (_abort_weight_group) and raises."""
        work = dist.broadcast(flat, src=0, group=self._weight_group[1], async_op=True)
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while not work.is_completed():
            refused = next((r for r in receivers if not r.is_alive() and r.error is not None), None)
            if refused is not None or time.monotonic() > deadline:
                self._abort_weight_group()
                raise refused.error if refused else TimeoutError(
                    f"the weight broadcast did not complete within {self.cfg.request_timeout_s:.0f} s")
            time.sleep(0.001)
        work.wait()

    def update_weights_from_distributed(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int,
                                        num_buckets: int) -> None:
        """Every engine receives each bucket as one flattened tensor (the `flattened_bucket` load format), broadcast
        from rank 0 of the weight group (connect_weight_group). `buckets` may be a stream (one bucket alive at a
        time): `num_buckets` says which is the last."""
        if self._weight_group is None:
            raise RuntimeError("update_weights_from_distributed needs connect_weight_group() first (a failed "
                               "broadcast aborts the group: form another)")
        engines = range(len(self.urls))

        def send() -> None:
            for engine in engines:
                self.begin_weight_update(engine)
            for b, bucket in enumerate(buckets):
                flat, metadata = flatten_bucket(bucket)
                payload = {"names": [m.name for m in metadata],
                           "dtypes": [str(m.dtype).removeprefix("torch.") for m in metadata],
                           "shapes": [list(m.shape) for m in metadata], "group_name": self._weight_group[0],
                           "load_format": "flattened_bucket", **self._bucket_labels(version, b == num_buckets - 1)}
                calls = [self._in_thread(lambda e=engine: self._call(e, "POST", "/update_weights_from_distributed",
                                                                     payload))
                         for engine in engines]
                # on a failure raises at once: the calls of the other engines end as _update_all restarts them
                self._broadcast(flat, calls)
                for call in calls:
                    call.join_or_raise()
            for engine in engines:
                self.end_weight_update(engine, version)

        self._update_all(send, version, "from distributed")

    def update_weights_from_disk(self, path: str, version: int) -> None:
        def send() -> None:
            for engine in range(len(self.urls)):
                self._call(engine, "POST", "/update_weights_from_disk",
                           {"model_path": str(path), "weight_version": str(version)})

        self._update_all(send, version, f"from disk ({path})")
        self._disk_weights = (str(path), version)

    @staticmethod
    def _in_thread(fn: Callable[[], object]) -> "_Call":
        call = _Call(fn)
        call.start()
        return call

    # ---------------------------------------------------------------- phases

    def _all(self, path: str, payload: dict | None = None, engines: Iterable[int] | None = None) -> None:
        """A control call to every engine (or `engines`); a launched server found dead is restarted (its
        on_restart runs) and asked again."""
        for engine in range(len(self.urls)) if engines is None else engines:
            try:
                self._call(engine, "POST", path, payload)
            except requests.ConnectionError as error:
                server = self.servers[engine]
                if server is None:
                    raise
                log.warning("engine %d failed %s (%s); recovering", engine, path, error)
                self.recover(engine)
                try:
                    self._call(engine, "POST", path, payload)
                except requests.ConnectionError as again:
                    raise EngineDown(f"engine {engine} failed {path} ({again}); log tail ({server.log_path}):\n"
                                     f"{server.log_tail()}") from again

    def pause(self, engines: Iterable[int] | None = None) -> None:
        """Stops generation (of every engine, or of `engines`) for a weight update. Requests in flight are retracted
        to the waiting queue with their output so far, and their KV cache is recomputed when generation resumes: the
        tokens generated after the update are exactly the new weights' (measured: within 2e-5 of a recomputation with
        them), and each keeps the version that produced it (a partial rollout). SGLang's "in_place" would keep the
        old weights' KV cache under the new tokens (off by ~8 nats here, and /flush_cache fails while they run);
        "abort" (its default) would end the requests."""
        self._all("/pause_generation", {"mode": "retract"}, engines)

    def resume(self, engines: Iterable[int] | None = None) -> None:
        self._all("/continue_generation", {}, engines)

    def flush_cache(self) -> None:
        """Empties the engines' prefix cache, once the requests in flight through this client are answered and the
        scheduler has retired their batch (the last answers can reach us before it has): /flush_cache with a timeout
        answers once it is idle."""
        with self._lock:
            self._lock.wait_for(lambda: not any(self._inflight))
        self._all(f"/flush_cache?timeout={self.cfg.request_timeout_s}")

    def release_memory(self, tags: Iterable[str] = WEIGHTS_TAGS + KV_CACHE_TAGS) -> None:
        """Frees the engines' device memory of `tags` (weights, KV cache, CUDA graphs; it takes --enable-memory-saver
        on GPU). SGLang's scheduler asserts that it is idle on a release and dies if not: flush_cache waits until it
        is, and flushes, as a release does."""
        self.flush_cache()
        for engine in range(len(self.urls)):
            todo = [tag for tag in tags if tag not in self.released[engine]]
            if todo:
                self._all("/release_memory_occupation", {"tags": todo}, engines=[engine])
                self.released[engine].update(todo)

    def resume_memory(self, tags: Iterable[str] = WEIGHTS_TAGS + KV_CACHE_TAGS) -> None:
        """Brings back what release_memory freed of `tags` (SGLang fails on resuming a tag it holds)."""
        for engine in range(len(self.urls)):
            todo = [tag for tag in tags if tag in self.released[engine]]
            if todo:
                self._all("/resume_memory_occupation", {"tags": todo}, engines=[engine])
                self.released[engine].difference_update(todo)

    def healthy(self) -> bool:
        return all(self._healthy(engine) for engine in range(len(self.urls)))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        stops = [_Call(server.stop) for server in self.servers if server is not None]  # ~1 s each: all at once
        for stop in stops:
            stop.start()
        for stop in stops:
            stop.join_or_raise()
        self._session.close()
        atexit.unregister(self.shutdown)


class _Call(threading.Thread):
    """A thread that keeps its function's exception for the joiner."""

    def __init__(self, fn: Callable[[], object]):
        super().__init__(daemon=True)
        self.fn, self.error = fn, None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as error:  # noqa: BLE001
            self.error = error

    def join_or_raise(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error
