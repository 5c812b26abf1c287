"""The SGLang rollout engine against transformers, on a real SGLang server on CPU (fp32).
Generation stops at the model's EOS (config.json) and at the given stop tokens, in both.

Tolerance for log-probs: 1e-4 absolute (fp32 on both sides; measured ~3e-6).
The tests share one engine (conftest.py); a test that changes the weights restores the launch weights from disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from rlhf_mc.rollout.base import SamplingParams
from rlhf_mc.rollout.sglang_engine import (INCONSISTENT_VERSION, KV_CACHE_TAGS, LAUNCH_VERSION, WEIGHTS_TAGS,
                                           WeightUpdateError, tensor_payload)
from rlhf_mc.runtime.spawn import free_port
from tests.conftest import write_tiny_qwen2

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [200], list(range(20, 60))]
TOL = 1e-4


def _hf(path):
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy(model, prompt, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)  # stops at the model's EOS, as the engine does
    return out[0, len(prompt):].tolist()


def _logprobs(model, prompt, response, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _assert_greedy_matches(engine, model, version):
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    for prompt, sample in zip(PROMPTS, samples):
        assert sample.response_ids == _greedy(model, prompt, 10)
        assert set(sample.versions) == {version}
        assert (torch.tensor(sample.logprobs) - _logprobs(model, prompt, sample.response_ids)).abs().max() < TOL


def test_greedy_generation_and_logprobs_equal_transformers(sglang_engine, tiny_hf_model):
    _assert_greedy_matches(sglang_engine, _hf(tiny_hf_model), LAUNCH_VERSION)


def test_a_server_imports_only_the_model_classes_we_serve(sglang_engine):
    """rollout/sglang_models lists a class for every causal-LM architecture the bridge maps, and a server started by
    us imports those alone (SGLang logs every default model module it tries and fails to import; without the
    package it tries all ~200), and no Megatron-Core (on CPU; its debug dumper would import it)."""
    from rlhf_mc.bridge.hf_config import ARCHITECTURES
    from rlhf_mc.rollout.sglang_models.served import EntryClass

    assert sorted(c.__name__ for c in EntryClass) == sorted(a for a in ARCHITECTURES if a.endswith("ForCausalLM"))
    log = sglang_engine.servers[0].log_path.read_text(errors="replace")
    assert "Ignore import error when loading sglang.srt.models." not in log and "Megatron" not in log


def test_n_samples_with_temperature_scaled_logprobs(sglang_engine, tiny_hf_model):
    model = _hf(tiny_hf_model)
    samples = sglang_engine.generate(PROMPTS[:2], SamplingParams(n=4, temperature=0.7, max_new_tokens=12))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, i) for p in range(2) for i in range(4)]
    assert len({tuple(s.response_ids) for s in samples if s.prompt_index == 0}) > 1, "4 identical samples"
    for s in samples:
        assert len(s.response_ids) == len(s.logprobs)
        assert (s.finish_reason, len(s.response_ids)) == ("length", 12) or \
            (s.finish_reason, s.response_ids[-1]) == ("stop", model.config.eos_token_id)
        expected = _logprobs(model, PROMPTS[s.prompt_index], s.response_ids, temperature=0.7)
        assert (torch.tensor(s.logprobs) - expected).abs().max() < TOL


def test_sampled_tokens_follow_the_models_distribution(sglang_engine, tiny_hf_model):
    """The server's draws (on CPU, rollout/cpu_sampling.py): 4000 first tokens of one prompt at temperature 0.8
    against transformers' probabilities, a chi-square over the tokens expected at least 5 times (the rest pooled),
    bounded 6 standard deviations above its mean (a draw one token off gives thousands)."""
    prompt, n, temperature = PROMPTS[1], 4000, 0.8
    samples = sglang_engine.generate([prompt], SamplingParams(n=n, temperature=temperature, max_new_tokens=1))
    with torch.no_grad():
        logits = _hf(tiny_hf_model)(torch.tensor([prompt])).logits[0, -1].double()
    expected = n * torch.softmax(logits / temperature, -1)
    counts = torch.bincount(torch.tensor([s.response_ids[0] for s in samples]), minlength=len(expected)).double()
    often = expected >= 5
    observed, expected = (torch.cat([c[often], c[~often].sum()[None]]) for c in (counts, expected))
    chi2, df = ((observed - expected) ** 2 / expected).sum().item(), len(expected) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)


def test_stop_token_ends_the_response(sglang_engine, tiny_hf_model):
    greedy = _greedy(_hf(tiny_hf_model), PROMPTS[0], 10)
    stop = greedy[3]
    (sample,) = sglang_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10,
                                                                    stop_token_ids=(stop,)))
    assert sample.finish_reason == "stop"
    assert sample.response_ids == greedy[:greedy.index(stop) + 1]
    # ignore_eos: past the stop token, to the budget
    (sample,) = sglang_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10,
                                                                    stop_token_ids=(stop,), ignore_eos=True))
    assert (sample.finish_reason, sample.response_ids) == ("length", greedy)


def test_context_limit_is_reported_not_cut(sglang_engine):
    engine = sglang_engine
    before = dict(engine.stats)
    near_limit = [3] * engine.max_prompt_length  # the longest prompt the server takes
    too_long = [3] * (engine.max_prompt_length + 1)
    room = engine.max_sequence_length - len(near_limit)
    assert 0 < room < 20
    samples = engine.generate([near_limit, too_long, [4, 5]], SamplingParams(temperature=0, max_new_tokens=20))
    assert samples[0].finish_reason == "context_length" and len(samples[0].response_ids) == room
    assert samples[1].finish_reason == "context_length" and samples[1].response_ids == []
    assert samples[2].finish_reason == "length" and len(samples[2].response_ids) == 20
    assert engine.stats["response_over_context"] == before.get("response_over_context", 0) + 1
    assert engine.stats["prompt_over_context"] == before.get("prompt_over_context", 0) + 1


def test_sessions_pick_engines_and_budgets_are_per_prompt(sglang_engine):
    """Two clients' worth of engines (the one server attached twice): each session's requests go to engine
    session % 2, whatever the load, in requests of at most max_concurrency samples (here 6 and 4 samples in
    requests of 3: each sample once, in its place); per-prompt max_new_tokens cap each response, the context still
    caps all."""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    address = sglang_engine.urls[0].removeprefix("http://")
    engines = SGLangEngine(RolloutConfig(addresses=(address, address), num_engines=2, max_concurrency=3))
    sessions, prompts = [5, 2, 2, 7, 4], [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14], [15, 16]]
    greedy = SamplingParams(temperature=0, max_new_tokens=9, n=2)
    samples = engines.generate(prompts, greedy, sessions)
    assert [s.engine for s in samples] == [session % 2 for session in sessions for _ in range(2)]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, i) for p in range(5) for i in range(2)]
    alone = [sglang_engine.generate([prompt], greedy)[0].response_ids for prompt in prompts]
    assert [s.response_ids for s in samples] == [ids for ids in alone for _ in range(2)]
    near_limit = [3] * sglang_engine.max_prompt_length
    samples = sglang_engine.generate([[5, 6, 7], [8, 9], near_limit], SamplingParams(temperature=0, max_new_tokens=9),
                                     max_new_tokens=[1, 4, 50])
    assert [len(s.response_ids) for s in samples[:2]] == [1, 4] and samples[1].finish_reason == "length"
    assert samples[2].finish_reason == "context_length"
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\]: must be >= 1, got 0"):
        sglang_engine.generate([[5], [6]], SamplingParams(), max_new_tokens=[3, 0])


def test_server_keeps_idle_connections_open(sglang_engine):
    """SGLang closes a connection idle for 5 s by default; a request the client sends on it just as it closes fails
    ("Connection reset by peer") and costs a retry through a health check (seen every step once steps took ~5 s).
    Launched servers keep idle connections open as long as a request may take."""
    import http.client

    host, port = sglang_engine.urls[0].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", "/get_server_info")
    connection.getresponse().read()
    time.sleep(6)
    connection.sock.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing to read: still open (b"" would be the server's close)
        connection.sock.recv(1)
    connection.close()


def test_seed_needs_a_deterministic_engine(sglang_engine):
    """Launched here or attached (whose flag is read from the server), a server started without
    --enable-deterministic-inference refuses per-sample seeds."""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    attached = SGLangEngine(RolloutConfig(addresses=(sglang_engine.urls[0].removeprefix("http://"),)))
    assert not sglang_engine.deterministic and not attached.deterministic
    for engine in (sglang_engine, attached):
        with pytest.raises(ValueError, match="sampling.seed: SGLang honours per-sample seeds only on servers started "
                                             "with --enable-deterministic-inference"):
            engine.generate(PROMPTS, SamplingParams(seed=1))


@pytest.fixture
def new_weights(tmp_path):
    return write_tiny_qwen2(tmp_path / "new", seed=1)


@pytest.fixture
def restore_launch_weights(sglang_engine, tiny_hf_model):
    yield
    sglang_engine.update_weights_from_disk(str(tiny_hf_model), version=LAUNCH_VERSION)


def test_update_from_tensors(sglang_engine, new_weights, restore_launch_weights):
    model = _hf(new_weights)
    state = list(model.state_dict().items())
    sglang_engine.update_weights_from_tensors([state[:10], state[10:]], version=3)  # two buckets
    assert sglang_engine.weight_version == 3
    _assert_greedy_matches(sglang_engine, model, 3)


def test_tokens_between_the_buckets_of_an_update_claim_no_version(sglang_engine, new_weights,
                                                                  restore_launch_weights):
    """Each bucket's load labels the engine (SGLang records the label with a load that succeeded): the buckets
    before the last INCONSISTENT_VERSION, the last the new version. Tokens generated by a half-updated engine never
    claim a version; after the last bucket they are the new weights' (the old weights' prefix cache flushed)."""
    engine, model = sglang_engine, _hf(new_weights)
    state = list(model.state_dict().items())
    engine.begin_weight_update(0)
    try:
        engine.load_tensor_payloads(0, [tensor_payload(state[:10]).serialized], version=8, last=False)
        half = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=3))[0]
        assert half.versions == [INCONSISTENT_VERSION] * 3
        engine.load_tensor_payloads(0, [tensor_payload(state[10:]).serialized], version=8, last=True)
    finally:
        engine.end_weight_update(0, 8)
    _assert_greedy_matches(engine, model, 8)


def test_update_from_distributed(sglang_engine, new_weights, restore_launch_weights):
    model = _hf(new_weights)
    sglang_engine.connect_weight_group("127.0.0.1", free_port(), backend="gloo")
    tensors = list(model.state_dict().items())
    sglang_engine.update_weights_from_distributed([tensors[:10], tensors[10:]], version=4, num_buckets=2)  # 2 buckets
    _assert_greedy_matches(sglang_engine, model, 4)


def test_a_refused_broadcast_fails_at_once_and_the_next_group_replaces_it(sglang_engine, new_weights,
                                                                           restore_launch_weights):
    """An engine asked to receive over a group it does not have refuses the bucket before the broadcast (an HTTP
    400) and never joins it, so the broadcast cannot complete: rank 0 aborts it as soon as the refusal arrives, not
    at the group's timeout, 120 s here (SGLangEngine._broadcast; the client is attached, so nothing restarts the
    engine). A new group carries the weights, and the next one leaves it on both sides."""
    import requests
    import torch.distributed as dist

    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import EngineDown, SGLangEngine

    model = _hf(new_weights)
    tensors = list(model.state_dict().items())
    url = sglang_engine.urls[0]
    client = SGLangEngine(RolloutConfig(addresses=(url.removeprefix("http://"),), request_timeout_s=60))
    group = client.connect_weight_group("127.0.0.1", free_port(), group_name="ours")
    client._weight_group = ("theirs", group)  # the engine joined "ours": it has no group of that name
    start = time.monotonic()
    with pytest.raises(EngineDown) as failed:  # an attached engine cannot be restarted from here
        client.update_weights_from_distributed([tensors], version=9, num_buckets=1)
    assert time.monotonic() - start < 15, "the broadcast waited for the group's timeout"
    assert "/update_weights_from_distributed: HTTP 400" in str(failed.value.__context__), failed.value.__context__
    client.end_weight_update(0, LAUNCH_VERSION)  # what the restart would have closed
    requests.post(f"{url}/destroy_weights_update_group", json={"group_name": "ours"}, timeout=30).raise_for_status()

    second = client.connect_weight_group("127.0.0.1", free_port(), group_name="second")
    client.update_weights_from_distributed([tensors[:10], tensors[10:]], version=9, num_buckets=2)
    _assert_greedy_matches(sglang_engine, model, 9)
    def groups_left() -> int:
        log = sglang_engine.servers[0].log_path.read_text(errors="replace")
        return log.count('/destroy_weights_update_group HTTP/1.1" 200')

    left = groups_left()
    client.connect_weight_group("127.0.0.1", free_port(), group_name="third")
    assert groups_left() == left + 1
    with pytest.raises(ValueError):  # not a group of this process any more
        dist.get_backend(second)
    client.leave_weight_group()


def test_update_from_disk(sglang_engine, new_weights, restore_launch_weights):
    sglang_engine.update_weights_from_disk(str(new_weights), version=5)
    _assert_greedy_matches(sglang_engine, _hf(new_weights), 5)


def test_failed_update_leaves_a_working_engine(sglang_engine, tiny_hf_model, restore_launch_weights):
    bad = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))]  # wrong shape
    with pytest.raises(WeightUpdateError):
        sglang_engine.update_weights_from_tensors([bad], version=6)
    assert sglang_engine.healthy()
    _assert_greedy_matches(sglang_engine, _hf(tiny_hf_model), LAUNCH_VERSION)


def _generating(engine, n_prompts: int) -> tuple[threading.Thread, dict, list]:
    """A greedy batch of 200-token responses generating in a thread (result["samples"] when it ends), started."""
    prompts = [[i % 200 + 3, 7, 9] for i in range(n_prompts)]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        samples=engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=200))))
    worker.start()
    while engine._inflight[0] == 0:
        time.sleep(0.01)
    return worker, result, prompts


def test_release_while_generating_waits_for_idle_and_resume_restores(sglang_engine, tiny_hf_model):
    """SGLang's scheduler dies on a release that finds it busy; release_memory waits for the batch in flight to
    finish, and after resume_memory the engine answers as before (weights and KV cache back)."""
    engine = sglang_engine
    restarts = engine.stats["engine_restarts"]
    worker, result, prompts = _generating(engine, 16)
    assert worker.is_alive(), "the batch finished before the release: make it longer"
    engine.release_memory()
    worker.join(timeout=60)
    assert len(result["samples"]) == len(prompts)
    engine.resume_memory()
    assert engine.stats["engine_restarts"] == restarts and engine.healthy()
    _assert_greedy_matches(engine, _hf(tiny_hf_model), LAUNCH_VERSION)


def test_a_weight_update_during_generation_makes_partial_rollouts(sglang_engine, tiny_hf_model, new_weights,
                                                                 restore_launch_weights):
    """A sync while requests generate (pause -> update -> resume, as every sync transport does it): the requests go
    on with the new weights, and each token's version says which weights produced it. Those before the update are
    the launch weights' tokens, those after are exactly the new weights' (their KV cache recomputed: SGLang's
    retract, not in_place, whose tokens would attend to the old weights' cache)."""
    engine = sglang_engine
    worker, result, prompts = _generating(engine, 64)
    time.sleep(0.2)
    assert worker.is_alive(), "the batch finished before the update: make it longer"
    new = _hf(new_weights)
    engine.pause()
    engine.update_weights_from_tensors([list(new.state_dict().items())], version=7)
    engine.resume()
    worker.join(timeout=120)
    old, spanning = _hf(tiny_hf_model), 0
    for prompt, sample in zip(prompts, result["samples"]):
        k = sample.versions.count(LAUNCH_VERSION)
        assert sample.versions == [LAUNCH_VERSION] * k + [7] * (len(sample.versions) - k)
        spanning += 0 < k < len(sample.versions)
        got = torch.tensor(sample.logprobs)
        assert torch.allclose(got[:k], _logprobs(old, prompt, sample.response_ids)[:k], rtol=0, atol=TOL)
        assert torch.allclose(got[k:], _logprobs(new, prompt, sample.response_ids)[k:], rtol=0, atol=TOL)
    assert spanning, "no response spans the update"


def test_killed_server_is_restarted_and_the_batch_completes(sglang_engine, tiny_hf_model):
    """A server killed while it generates is restarted; on_restart runs before the lost requests are retried (the
    trainer gives the engine its current weights there); the batch completes on the restarted server. A server
    found dead by a control call between phases is restarted too, and the call succeeds."""
    engine = sglang_engine
    restarts = engine.stats["engine_restarts"]
    calls = []
    engine.on_restart = lambda e: calls.append((e, "samples" in result))
    try:
        worker, result, prompts = _generating(engine, 256)
        time.sleep(0.2)
        assert worker.is_alive(), "the batch finished before the kill: make it longer"
        engine.servers[0].proc.kill()  # the server's main process; its schedulers follow
        worker.join(timeout=300)
        assert not worker.is_alive()
        assert engine.stats["engine_restarts"] == restarts + 1
        assert calls == [(0, False)], "on_restart must run once, before the batch is answered"
        model = _hf(tiny_hf_model)
        for prompt, sample in zip(prompts[:2], result["samples"][:2]):
            assert sample.response_ids == _greedy(model, prompt, 200)
        assert len(result["samples"]) == len(prompts) and engine.healthy()

        engine.servers[0].proc.kill()
        engine.servers[0].proc.wait()
        engine.release_memory()
        assert engine.stats["engine_restarts"] == restarts + 2 and calls[-1][0] == 0 and len(calls) == 2
        engine.resume_memory()
        _assert_greedy_matches(engine, model, LAUNCH_VERSION)
    finally:
        engine.on_restart = None


def test_a_server_restarted_while_released_gives_its_memory_back_again(sglang_engine, tiny_hf_model):
    """Colocated, the engines' memory is released while the trainer works; a server that dies then and is restarted
    by the next control call comes back holding all of it: it is released again (so the trainer keeps the memory,
    and the resume that follows finds the tags released, as SGLang requires), and then answers as before."""
    engine = sglang_engine
    restarts = engine.stats["engine_restarts"]
    log = engine.servers[0].log_path
    engine.release_memory()
    try:
        engine.servers[0].proc.kill()
        engine.servers[0].proc.wait()
        releases = lambda: log.read_text(errors="replace").count('"POST /release_memory_occupation HTTP/1.1" 200')
        seen = releases()
        engine.recover(0)
        assert engine.stats["engine_restarts"] == restarts + 1 and releases() == seen + 1
        assert engine.released[0] == set(WEIGHTS_TAGS + KV_CACHE_TAGS)
    finally:
        engine.resume_memory()
    _assert_greedy_matches(engine, _hf(tiny_hf_model), LAUNCH_VERSION)


def test_idle_server_sleeps_instead_of_polling(sglang_engine):
    """Between rollouts a server waits for the trainer: its processes together use under a fifth of a core (a
    busy-polling scheduler takes a whole one, 1.0 core-seconds per second measured; with --sleep-on-idle 0.015),
    and the next request is still answered."""
    server = psutil.Process(sglang_engine.servers[0].proc.pid)

    def cpu_seconds() -> float:
        total = 0.0
        for p in [server, *server.children(recursive=True)]:
            try:
                total += sum(p.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total

    time.sleep(1)  # the end of the previous test's requests
    before, start = cpu_seconds(), time.monotonic()
    time.sleep(4)
    assert (cpu_seconds() - before) / (time.monotonic() - start) < 0.2
    (sample,) = sglang_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=2))
    assert len(sample.response_ids) == 2


def test_server_children_outlive_the_starting_thread_and_die_with_the_process():
    """A server restarted from a request thread must not die when that thread ends, and must die (SIGKILL) with the
    process that owns it, as one started from the main thread does."""
    code = ("import threading, time\nfrom rlhf_mc.rollout.sglang_server import start_child\nout = []\n"
            "t = threading.Thread(target=lambda: out.append(start_child(['sleep', '300'])))\nt.start()\nt.join()\n"
            "print(out[0].pid, flush=True)\ntime.sleep(300)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        child = psutil.Process(int(owner.stdout.readline()))
        time.sleep(1)
        assert child.status() != psutil.STATUS_ZOMBIE, "the child died with the thread that started it"
    finally:
        owner.kill()
        owner.wait()
    deadline = time.time() + 10
    while True:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:  # dead; its new parent may not reap it
                break
        except psutil.NoSuchProcess:
            break
        assert time.time() < deadline, "the child outlived its owner"
        time.sleep(0.1)


def test_cpu_server_threads_are_its_device_slots_cores_not_rays_one():
    """A server started from a Ray actor inherits OMP_NUM_THREADS=1 (Ray's default): on CPU it would decode on one
    core while the trainer ranks sit idle. Each of its TP ranks gets the cores of one device slot instead, an equal
    share of the machine's, and SGLang is told which (on an 8-core machine: slots of 4 cores when there are two, 2
    when there are four, shared cores when the slots outnumber them)."""
    from rlhf_mc.rollout import cpu

    cores = os.cpu_count()
    env = cpu.server_env({"OMP_NUM_THREADS": "1"}, range(1), 1)
    assert env["OMP_NUM_THREADS"] == str(cores)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == ("0" if cores == 1 else f"0-{cores - 1}")
    assert cpu.server_env({"OMP_NUM_THREADS": "1"}, range(1, 2), 2)["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert cpu.thread_binding(range(1), 1, cores=8) == "0-7"
    assert cpu.thread_binding(range(1, 2), 2, cores=8) == "4-7"  # the second of two engines
    assert cpu.thread_binding(range(2, 4), 4, cores=8) == "4-5|6-7"  # the TP ranks of the second TP=2 engine
    assert cpu.thread_binding(range(4), 4, cores=2) == "0|0|1|1"


def test_cpu_server_gets_mkl_avx512_kernels_after_inherited_preloads():
    """On an AMD CPU the server's matmuls take MKL's AVX-512 kernels as the trainer ranks' do (runtime/host.py), a
    preload it inherits is kept, and the library is not preloaded twice."""
    from rlhf_mc.rollout import cpu
    from rlhf_mc.runtime import host

    lib = host.mkl_preload()
    if lib is None:
        pytest.skip("not an AMD CPU with MKL, or no C compiler")
    assert cpu.server_env({}, range(1), 1)["LD_PRELOAD"] == lib
    assert cpu.server_env({"LD_PRELOAD": "/x/a.so"}, range(1), 1)["LD_PRELOAD"] == f"/x/a.so {lib}"
    assert cpu.server_env({"LD_PRELOAD": f"/x/a.so {lib}"}, range(1), 1)["LD_PRELOAD"] == f"/x/a.so {lib}"


def _answering_server(health_status: int):
    """An HTTP server on loopback that answers SGLang's server info, /health with `health_status`, and every POST
    with HTTP 500: a server whose own request failed (alive) or a proxy in front of a dead one (health 503)."""
    import http.server
    import json as json_

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict) -> None:
            data = json_.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/get_server_info":
                self._answer(200, {"tp_size": 1, "enable_deterministic_inference": False, "max_req_input_len": 100})
            else:
                self._answer(health_status, {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._answer(500, {"error": "boom"})

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("health_status", [200, 503])
def test_http_5xx_from_a_live_server_is_an_error_not_a_dead_server(health_status):
    """A live server's HTTP 500 is raised with its message and no retry or restart; the same answer while its
    health check fails is a dead server's, recovered from (an attached one cannot be restarted: said so)."""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import EngineDown, ServerError, SGLangEngine

    server = _answering_server(health_status)
    try:
        engine = SGLangEngine(RolloutConfig(addresses=(f"127.0.0.1:{server.server_address[1]}",)))
        expected = ServerError if health_status == 200 else EngineDown
        with pytest.raises(expected) as error:
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        if health_status == 200:
            assert 'HTTP 500 from a live server (not restarted): {"error": "boom"}' in str(error.value)
            assert engine.stats["request_retries"] == 0
        else:
            assert "needs a restart, but it was not launched here" in str(error.value)
        engine.shutdown()
    finally:
        server.shutdown()


def test_cpu_patches_refuse_another_sglang_release_and_a_moved_function(tmp_path):
    """The server-side CPU patches (rollout/cpu_site/sitecustomize.py) check SGLang's release before anything is
    patched, and a patched module without the function it replaces fails its import by name, not unpatched."""
    site = REPO / "rlhf_mc" / "rollout" / "cpu_site" / "sitecustomize.py"
    other_release = (f"import importlib.metadata as m; m.version = lambda name: '0.5.22'; import runpy; "
                     f"runpy.run_path({str(site)!r})")
    run = subprocess.run([sys.executable, "-c", other_release], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and ("RuntimeError: sglang 0.5.22: rlhf_mc's CPU patches (rlhf_mc/rollout/cpu_site) "
                                    "are written for sglang 0.5.23") in run.stderr, run.stderr[-2000:]
    (tmp_path / "moved_tp_worker.py").write_text("class TpWorker:\n    pass\n")  # no BaseTpWorker
    moved = (f"import runpy, sys; sys.path.insert(0, {str(tmp_path)!r}); ns = runpy.run_path({str(site)!r}); "
             "ns['_staging_stays_mapped'].__globals__['_PATCHES']['moved_tp_worker'] = ns['_staging_stays_mapped']; "
             "import moved_tp_worker")
    run = subprocess.run([sys.executable, "-c", moved], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and ("RuntimeError: rlhf_mc's CPU patch _staging_stays_mapped of moved_tp_worker "
                                    "found no 'BaseTpWorker' (written for sglang 0.5.23)") in run.stderr, (
        run.stderr[-2000:])


def test_a_taken_base_port_is_refused_before_a_server_starts(tiny_hf_model, tmp_path):
    """rollout.engine.base_port on a port another process listens on: refused by name before any server starts
    (otherwise that process would answer our health checks and requests)."""
    import socket

    from rlhf_mc.config import ConfigError, RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^rollout.engine.base_port: port {port} on 127.0.0.1 \(engine 0\) is "
                                              r"in use \(Address already in use\); choose another base_port, or 0"):
            SGLangEngine(RolloutConfig(model_path=str(tiny_hf_model), base_port=port), log_dir=tmp_path)
    assert not list(tmp_path.glob("*.log"))  # no server was started


def test_a_tp1_servers_scheduler_is_forked_not_spawned(sglang_engine):
    """On CPU a TP=1 server forks its scheduler and detokenizer (cpu_site/sitecustomize.py: they start with SGLang
    imported, ~20 s sooner). SGLang's import-time warning (AWQ is CUDA-only: two log lines) is then in a server's
    log once per start, from its HTTP process; spawned children import SGLang again and print it again (6 lines a
    start, seen in the logs of runs before the fork)."""
    log = (sglang_engine.log_dir / "sglang_engine0.log").read_text(errors="replace")
    starts = log.count("server_args=")
    assert starts >= 1 and log.count("support AWQ currently") == 2 * starts, log[-3000:]


def test_gpu_servers_take_the_gpus_of_their_slots(monkeypatch, tmp_path):
    """On GPU each server's TP ranks start at the first GPU of its slots (--base-gpu-id): two TP=2 engines of one
    SGLangEngine on GPUs 0-1 and 2-3 (without it both took 0-1); the CPU command has no such flag (its slots are
    cores)."""
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout import cpu
    from rlhf_mc.rollout.sglang_server import ServerProcess

    cfg = RolloutConfig(model_path="m", tp=2, num_engines=2)

    def base_gpu(slots: range) -> str | None:
        cmd = ServerProcess(1, cfg, 30000, tmp_path, False, slots, 4).command()
        return cmd[cmd.index("--base-gpu-id") + 1] if "--base-gpu-id" in cmd else None

    assert base_gpu(range(2, 4)) is None  # on CPU
    monkeypatch.setattr(cpu, "on_cpu", lambda: False)
    assert [base_gpu(range(0, 2)), base_gpu(range(2, 4))] == ["0", "2"]
