"""Weight sync from a TP=2 x PP=2 actor into SGLang engines at TP=1 and TP=2, and from an EP=2 x PP=2 DeepSeek-V3
actor (multi-latent attention and MoE, each rank holding half the experts), after optimizer steps that change the
weights of every pipeline stage: each time, each engine's log-probs equal the actor's (1e-4, fp32) and its samples
carry the new version; at the end its greedy output equals transformers' on the actor's exported weights. Ten more
syncs show no memory growth.

Colocated ("tensor"), on CPU one host: every rank writes its shares into one shared-memory staging, and rank 0 posts
it. On GPU (ColocatedTensors, checked here on CPU by building it directly) each engine TP rank's payload must come
from the trainer rank assigned to its device. On CPU a payload names the shared-memory file it refers to, and torch
names those files after the process that made them (/torch_<pid>_...): the tests read the producer of every payload an
engine received from the payload itself."""

from __future__ import annotations

import base64
import os
import pickletools
import re
from pathlib import Path

import psutil
import pytest
import torch

from rlhf_mc.config import ParallelConfig
from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.rollout.sglang_engine import LAUNCH_VERSION
from rlhf_mc.runtime.spawn import spawn

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [200, 3]]
STEPS, REPEATS = 3, 10


def _actor_logprobs(chunks, responses: list[list[int]]) -> list[torch.Tensor]:
    """The actor's log-probs of each of PROMPTS' responses."""
    from rlhf_mc.data.trajectory import Trajectories
    from rlhf_mc.workers.policy import compute_log_prob

    batch = Trajectories.single_turn([p + r for p, r in zip(PROMPTS, responses)], [len(p) for p in PROMPTS])
    return batch.masked(compute_log_prob(chunks, batch)["logprobs"])


def training_batch(vocab_size: int):
    """What the actor trains on between syncs: three random sequences with advantages (and old log-probs)."""
    from rlhf_mc.data.trajectory import Trajectories

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g) for n in (14, 9, 20)]
    starts = [4, 3, 6]
    per_token = {"advantages": [torch.randn(len(s) - st, generator=g) for s, st in zip(seqs, starts)],
                 "old_logprobs": [torch.full((len(s) - st,), -5.5) for s, st in zip(seqs, starts)]}
    return Trajectories.single_turn(seqs, starts, per_token)


def shared_files(serialized: str) -> set[bytes]:
    """The shared-memory files a CPU payload refers to."""
    strings = [arg for _, arg, _ in pickletools.genops(base64.b64decode(serialized)) if isinstance(arg, bytes)]
    return {s for s in strings if re.match(rb"/torch_\d+_", s)}


def payload_producer(serialized: str) -> int:
    """The pid of the process whose shared memory a CPU payload refers to."""
    pids = {int(re.match(rb"/torch_(\d+)_", s).group(1)) for s in shared_files(serialized)}
    assert len(pids) == 1, serialized
    return pids.pop()


def _actor(model_dir: str, engines: list[tuple[str, list[int]]], transport: str, export_dir: str,
           parallel: ParallelConfig) -> dict | None:
    """`engines`: (address, the trainer ranks on its devices) each. The payloads this rank posts are recorded by
    patching the engine client's class, restored after: the ranks are kept for the next test (RLHF_MC_KEEP_RANKS),
    which a recorder of this test's engines would break (a ValueError in its sync, counted as a failed engine, left
    it paused and its next generate waiting)."""
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    load, from_disk = SGLangEngine.load_tensor_payloads, SGLangEngine.update_weights_from_disk
    try:
        return _recorded_actor(load, from_disk, model_dir, engines, transport, export_dir, parallel)
    finally:
        SGLangEngine.load_tensor_payloads, SGLangEngine.update_weights_from_disk = load, from_disk


def _recorded_actor(load, from_disk, model_dir: str, engines: list[tuple[str, list[int]]], transport: str,
                    export_dir: str, parallel: ParallelConfig) -> dict | None:
    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.safetensors_io import write_hf_checkpoint
    from rlhf_mc.bridge.weights import export_hf_weights, load_hf_weights
    from rlhf_mc.config import OptimizerConfig, RolloutConfig
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.optim import setup_training
    from rlhf_mc.rollout.sglang_engine import SGLangEngine
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.sync.transports import ColocatedTensors, connect
    from rlhf_mc.sync.weights import WeightSync, check_versions
    from rlhf_mc.config import PolicyLossConfig
    from rlhf_mc.workers.train import train_step

    # (engine, producer pid per TP rank) per bucket this rank posted; the shared-memory files the payloads name
    received: list[tuple[int, list[int]]] = []
    files: set[bytes] = set()

    def recording(self, engine, payloads, *labels, **named_labels):
        received.append((addresses.index(self.urls[engine].removeprefix("http://")),
                         [payload_producer(p) for p in payloads]))
        files.update(*(shared_files(p) for p in payloads))
        return load(self, engine, payloads, *labels, **named_labels)

    disk_paths: list[str] = []  # the checkpoints the disk transport had the engines read

    def recording_disk(self, path, *args, **kwargs):
        disk_paths.append(path)
        return from_disk(self, path, *args, **kwargs)

    SGLangEngine.load_tensor_payloads = recording
    SGLangEngine.update_weights_from_disk = recording_disk
    init_parallel(parallel, seed=3)
    model = model_config_from_hf(read_hf_config(model_dir))
    chunks = build_model(model, parallel, init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    state = setup_training(chunks, OptimizerConfig(lr=2e-2, weight_decay=0.0))
    rank = torch.distributed.get_rank()
    addresses = [address for address, _ in engines]
    clients = [SGLangEngine(RolloutConfig(addresses=(a,))) for a in addresses] if rank == 0 else []
    engine_ranks = [ranks for _, ranks in engines]
    sink = ColocatedTensors(addresses, engine_ranks) if transport == "per device" else \
        connect(transport, addresses, engine_ranks, config_from=model_dir, staging_dir=export_dir + "_staging")
    sync = WeightSync(chunks, model, sink, bucket_bytes=20_000)
    steps = []
    for version in range(1, STEPS + 1):
        train_step(state, training_batch(model.vocab_size), PolicyLossConfig(), micro_batch_tokens=64)
        stats = sync.sync(chunks, version)
        box = [None]
        if rank == 0:
            box = [[]]
            for client in clients:
                samples = client.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
                check_versions([v for s in samples for v in s.versions], version)
                box[0].append([(s.response_ids, s.logprobs) for s in samples])
        torch.distributed.broadcast_object_list(box, src=0)
        actor = [_actor_logprobs(chunks, [r for r, _ in per_engine]) for per_engine in box[0]]
        steps.append({"engines": box[0], "actor": actor, "stats": stats})
    rss = []
    for version in range(STEPS + 1, STEPS + 1 + REPEATS):
        sync.sync(chunks, version)
        rss.append(psutil.Process().memory_info().rss / 2**20)
    exported = list(pair for bucket in export_hf_weights(chunks, sync.plan, model) for pair in bucket)
    out = {"pid": os.getpid(), "received": received, "files": files, "disk_paths": disk_paths, "steps": steps,
           "rss_mb": rss,
           "transport": type(sync.transport).__name__}
    if rank == 0:
        from pathlib import Path

        write_hf_checkpoint(iter(exported), Path(export_dir))
        out["versions"] = [client.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=1))[0]
                           .versions[-1] for client in clients]
    return out


@pytest.fixture(scope="module")
def engine_tp2(tiny_hf_model, tmp_path_factory):
    """A second engine with TP=2 (each rank bound to its own core on CPU)."""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(RolloutConfig(model_path=str(tiny_hf_model), dtype="float32", tp=2),
                          log_dir=tmp_path_factory.mktemp("sglang_tp2_logs"))
    yield engine
    engine.shutdown()


def _run(engines, transport, tiny_hf_model, tmp_path, parallel: ParallelConfig = ParallelConfig(tp=2, pp=2)
         ) -> list[dict]:
    """Runs the actor against `engines` [(engine, its trainer ranks)]; checks every engine against the actor after
    every sync and against transformers at the end; returns every rank's result."""
    import shutil

    import transformers as T

    export_dir = tmp_path / "actor"
    export_dir.mkdir()
    placed = [(engine.urls[0].removeprefix("http://"), ranks) for engine, ranks in engines]
    try:
        results = spawn(_actor, 4, str(tiny_hf_model), placed, transport, str(export_dir), parallel)
        first = results[0]
        for step in first["steps"]:
            for per_engine, actor in zip(step["engines"], step["actor"]):
                for (_, engine_lp), actor_lp in zip(per_engine, actor):
                    assert (torch.tensor(engine_lp) - actor_lp).abs().max().item() < 1e-4
            stats = step["stats"]
            assert stats.buckets > 1 and stats.bytes > 0 and stats.seconds > 0 and not stats.failed
        greedy_by_step = [[r for r, _ in step["engines"][0]] for step in first["steps"]]
        assert greedy_by_step[0] != greedy_by_step[-1], "the updates did not change the engine's output"
        growth = first["rss_mb"][-1] - first["rss_mb"][2]
        assert growth < 20, f"rank 0 grew {growth:.1f} MB over {REPEATS - 3} syncs: {first['rss_mb']}"
        assert first["versions"] == [STEPS + REPEATS] * len(engines)

        shutil.copy2(tiny_hf_model / "config.json", export_dir / "config.json")
        model = T.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
        for engine, _ in engines:
            final = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
            for prompt, sample in zip(PROMPTS, final):
                with torch.no_grad():
                    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
                assert sample.response_ids == out[0, len(prompt):].tolist()
        return results
    finally:
        for engine, _ in engines:
            engine.update_weights_from_disk(str(tiny_hf_model), version=LAUNCH_VERSION)


def _sync_once(model_dir: str, address: str, kill_pid: int | None = None) -> dict:
    """A TP=2 actor with weights of its own connects to the engine at `address` (fed by rank 0), kills the server
    process `kill_pid` if given, syncs, and reports what failed and, where the sync went through, the gap between
    the engine's log-probs and its own."""
    import time

    import requests

    from rlhf_mc.bridge.hf_config import model_config_from_hf, read_hf_config
    from rlhf_mc.bridge.weights import load_hf_weights
    from rlhf_mc.models.gpt import build_model
    from rlhf_mc.runtime import init_parallel
    from rlhf_mc.sync.transports import connect
    from rlhf_mc.sync.weights import WeightSync, check_versions

    init_parallel(ParallelConfig(tp=2), seed=3)
    model = model_config_from_hf(read_hf_config(model_dir))
    chunks = build_model(model, ParallelConfig(tp=2), init_weights=False)
    load_hf_weights(chunks, model_dir, model)
    for p in chunks[0].parameters():  # weights of its own, so that a sync that did nothing shows
        p.data.mul_(1.5)
    transport = connect("tensor", [address], [[0]])
    if kill_pid is not None and torch.distributed.get_rank() == 0:
        psutil.Process(kill_pid).kill()
        while True:  # until the server answers no more (it is not this process's child: no wait)
            try:
                requests.get(f"http://{address}/health", timeout=5)
            except requests.ConnectionError:
                break
            time.sleep(0.1)
    out = {"failed": WeightSync(chunks, model, transport, bucket_bytes=20_000).sync(chunks, 1, engines=[0]).failed}
    box = [None]
    if torch.distributed.get_rank() == 0 and not out["failed"]:
        samples = transport.client.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
        check_versions([v for s in samples for v in s.versions], 1)
        box = [[(s.response_ids, s.logprobs) for s in samples]]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        actor = _actor_logprobs(chunks, [r for r, _ in box[0]])
        out["gap"] = max((torch.tensor(lp) - a).abs().max().item() for (_, lp), a in zip(box[0], actor))
    return out


def test_a_dead_engine_fails_its_sync_and_is_synced_after_its_restart(sglang_engine, tiny_hf_model):
    """The engine dies before a sync: the sync reports it failed on its feeding rank (the other rank did not wait
    for it in a collective); restarted (as the trainer's EngineWorker.recover does), it is synced and equals the
    actor."""
    address = sglang_engine.urls[0].removeprefix("http://")
    try:
        first, second = spawn(_sync_once, 2, str(tiny_hf_model), address, sglang_engine.servers[0].proc.pid)
        assert list(first["failed"]) == [0] and first["failed"][0].startswith("engine 0 at http://")
        assert second["failed"] == {}
        sglang_engine.recover(0)
        first, _ = spawn(_sync_once, 2, str(tiny_hf_model), address)
        assert first["failed"] == {} and first["gap"] < 1e-4
    finally:
        sglang_engine.recover(0)
        sglang_engine.update_weights_from_disk(str(tiny_hf_model), version=LAUNCH_VERSION)


@pytest.mark.parametrize("transport, engine_tp", [("tensor", 1), ("distributed", 1), ("disk", 1),
                                                  pytest.param("tensor", 2, marks=pytest.mark.slow)])
def test_sync_follows_every_update(transport, engine_tp, request, tiny_hf_model, tmp_path):
    engine = request.getfixturevalue("sglang_engine" if engine_tp == 1 else "engine_tp2")
    results = _run([(engine, list(range(engine_tp)))], transport, tiny_hf_model, tmp_path)
    if transport == "disk":  # each sync's checkpoint staged where the run said (the run folder), then removed
        paths = [Path(p) for p in results[0]["disk_paths"]]
        staging = {p.parent for p in paths}
        assert len(paths) == STEPS + REPEATS and len(staging) == 1 and staging.pop().name.endswith("_staging")
        assert not any(p.exists() for p in paths)
    if transport == "tensor":  # on CPU: one staging, made by rank 0, carries every bucket of every sync
        assert [r["transport"] for r in results] == ["SharedStaging"] * 4
        buckets = results[0]["steps"][0]["stats"].buckets
        assert results[0]["received"] == [(0, [results[0]["pid"]] * engine_tp)] * (buckets * (STEPS + REPEATS))
        assert len(results[0]["files"]) == 1 and not any(r["received"] for r in results[1:])
        # Every engine TP rank keeps the staging mapped from one load to the next (cpu_site/sitecustomize.py).
        (staging,) = results[0]["files"]
        schedulers = [p for p in psutil.Process(engine.servers[0].proc.pid).children(recursive=True)
                      if p.name().startswith("sglang::scheduler")]
        assert len(schedulers) == engine_tp
        assert all(any(staging.decode() in m.path for m in p.memory_maps()) for p in schedulers)


@pytest.mark.slow
def test_sync_from_an_expert_parallel_actor(tmp_path):
    """DeepSeek-V3 (multi-latent attention, 8 experts in 2 groups with a correction bias, a shared expert, a dense
    first layer) at EP=2 x PP=2: every expert reaches the engine (broadcast from the EP rank that holds it) under its
    HF name, the latent down projections SGLang fuses in one bucket (the buckets here are small enough to split them
    otherwise), and SGLang re-derives its absorbed attention weights from each new kv_b_proj. (Qwen3-MoE's sync is
    checked by the MoE trainer test.)"""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine
    from tests.test_bridge import _write_hf_model

    model_dir = tmp_path / "moe"
    _write_hf_model("deepseek_v3", model_dir)
    engine = SGLangEngine(RolloutConfig(model_path=str(model_dir), dtype="float32"), log_dir=tmp_path / "logs")
    try:
        _run([(engine, [0])], "tensor", model_dir, tmp_path, ParallelConfig(ep=2, pp=2))
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_colocated_engines_are_fed_by_the_ranks_on_their_devices(sglang_engine, engine_tp2, tiny_hf_model,
                                                                 tmp_path):
    """ColocatedTensors (the GPU path; connect takes SharedStaging on one CPU host), two colocated engines on one
    TP=2 x PP=2 actor: the TP=2 engine on the devices of trainer ranks 0 and 1
    (pipeline stage 0), the TP=1 engine on rank 2's (stage 1); rank 3's device has none. Every bucket each engine
    received came from those ranks, TP rank i's payload from the i-th; both engines equal the actor after every
    sync."""
    results = _run([(engine_tp2, [0, 1]), (sglang_engine, [2])], "per device", tiny_hf_model, tmp_path)
    pids = [r["pid"] for r in results]
    posted = {rank: r["received"] for rank, r in enumerate(results) if r["received"]}
    assert sorted(posted) == [0, 2], "each engine is driven by its first trainer rank, and only by it"
    buckets = results[0]["steps"][0]["stats"].buckets
    assert posted[0] == [(0, [pids[0], pids[1]])] * (buckets * (STEPS + REPEATS))
    assert posted[2] == [(1, [pids[2]])] * (buckets * (STEPS + REPEATS))


def test_buckets_share_one_staging_file_and_arrive_intact():
    """On CPU every bucket is laid out in the same shared-memory staging (a new file per bucket costs ~4x a copy):
    two buckets of mixed dtypes name one file, and each deserializes to its own tensors, bit for bit."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from rlhf_mc.rollout.sglang_engine import shared_staging, tensor_payload

    g = torch.Generator().manual_seed(0)
    buckets = [[("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)), ("b", torch.randn(7, generator=g)),
                ("c", torch.randn(4, 4, generator=g).t())],  # not contiguous
               [("d", torch.randn(2, 9, generator=g)), ("e", torch.randn(5, generator=g).to(torch.bfloat16))]]
    staging = shared_staging(1024)
    files = []
    for bucket in buckets:
        payload = tensor_payload(bucket, staging)
        files.append(shared_files(payload.serialized))
        received = MultiprocessingSerializer.deserialize(base64.b64decode(payload.serialized))
        tensors = dict(FlattenedTensorBucket(flattened_tensor=received["flattened_tensor"],
                                             metadata=received["metadata"]).reconstruct_tensors())
        assert tensors.keys() == dict(bucket).keys()
        for name, sent in bucket:
            assert tensors[name].dtype == sent.dtype and torch.equal(tensors[name], sent), name
    assert files[0] == files[1] and len(files[0]) == 1
    assert shared_files(tensor_payload(buckets[0]).serialized) != files[0]  # without staging: a file of its own
    with pytest.raises(ValueError, match="does not fit the 16-byte staging"):
        tensor_payload(buckets[0], shared_staging(16))
