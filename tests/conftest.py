"""Session-wide fixtures: one tiny HF model written by transformers, one SGLang engine serving it (a real server
on CPU, started once per test session because start-up takes ~11 s), and one Ray node for the launches that join a
cluster (`ray_address`).

The suite runs on the CPU on any machine: on one with GPUs they are hidden (before torch starts CUDA), so multi-rank
tests take gloo however few GPUs there are, and SGLang serves on the CPU. The GPU-only tests in tests/gpu/ run with
RLHF_MC_GPU_TESTS=1 (tools/gpu_check.sh)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("RLHF_MC_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The multi-rank jobs' processes serve the next job of the same shape (runtime/spawn.py): each fresh one costs ~9 s of
# process start and imports, most of a tiny model's job.
os.environ.setdefault("RLHF_MC_KEEP_RANKS", "1")

import psutil
import pytest
import torch

from rlhf_mc.runtime.spawn import free_port

RAY = str(Path(sys.executable).parent / "ray")
# For the Ray nodes the tests start and the launches that join them. Ray 2.60 turns on token authentication by
# default (the nodes talk over loopback only), and a head node told to stop drains for 30 s, waiting for work nobody
# left running.
RAY_SETTINGS = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def ray_env() -> dict[str, str]:
    return {**os.environ, **RAY_SETTINGS}


def _alive_ray_nodes(address: str) -> int:
    try:
        out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}', logging_level='ERROR');"
                              " print(sum(n['Alive'] for n in ray.nodes()))"], env=ray_env(), capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return 0
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


@contextlib.contextmanager
def ray_cluster(log_dir: Path, nodes: int, cpus: int, env: dict[str, str] | None = None):
    """`nodes` Ray nodes on loopback, a head and nodes - 1 more, of `cpus` CPUs each, started with `env` (else
    ray_env()); yields the head's address. `ray start --block`: each start process supervises its node's processes
    and takes them down when it is stopped."""
    address, env = f"127.0.0.1:{free_port()}", env or ray_env()
    ray_tmp = tempfile.mkdtemp(prefix="rr", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    procs = []

    def start(args: list[str], log: Path) -> None:
        procs.append(subprocess.Popen([RAY, "start", "--block", "--num-cpus", str(cpus), "--node-ip-address",
                                       "127.0.0.1", *args], env=env, start_new_session=True, stdout=open(log, "wb"),
                                      stderr=subprocess.STDOUT))
        deadline = time.time() + 120
        while _alive_ray_nodes(address) < len(procs):
            assert time.time() < deadline and all(p.poll() is None for p in procs), log.read_text()[-2000:]
            time.sleep(1)

    try:
        start(["--head", "--port", address.split(":")[1], "--include-dashboard", "false", "--temp-dir", ray_tmp],
              log_dir / "ray_head.log")
        for n in range(1, nodes):
            start(["--address", address], log_dir / f"ray_node{n}.log")
        yield address
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory) -> str:
    """One Ray node for the session, joined by the launches that test a run rather than Ray's own start (each saves
    the ~5 s of starting and stopping a local instance): tools/launch.py --address, as on a cluster. Its workers get
    what a local CPU instance gives them (host.exec_env: MKL's AVX-512 kernels, the allocator settings)."""
    from rlhf_mc.runtime import host

    env = ray_env()
    with ray_cluster(tmp_path_factory.mktemp("ray"), 1, 4, {**env, **host.exec_env(env)}) as address:
        yield address


def write_tiny_qwen2(out: Path, seed: int = 0, layers: int = 2, reward_labels: int | None = None) -> Path:
    """A random Qwen2-family model (GQA, qkv bias), far from init so that layout mistakes show; fp32. With
    `reward_labels`, a sequence-classification model (a reward model when 1 label)."""
    import transformers as T

    config = T.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                           rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                           num_labels=reward_labels or 2, pad_token_id=0)
    torch.manual_seed(seed)
    model = T.Qwen2ForSequenceClassification(config) if reward_labels else T.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2") / "model")


@pytest.fixture(scope="session")
def sglang_engine(tiny_hf_model, tmp_path_factory):
    from rlhf_mc.config import RolloutConfig
    from rlhf_mc.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(RolloutConfig(model_path=str(tiny_hf_model), dtype="float32", max_restarts=8),
                          log_dir=tmp_path_factory.mktemp("sglang_logs"))
    yield engine
    pids = [p.pid for s in engine.servers if s and s.proc
            for p in [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]]
    engine.shutdown()
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"], \
        "SGLang processes left behind after shutdown"


# A ChatML/Qwen2.5-style chat template written for the tests: the tools' schemas in the system prompt, consecutive
# tool results gathered in one user turn inside <tool_response> tags (Qwen2.5's layout).
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nYou may call functions.\\n<tools>' }}{%- for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def write_chat_tokenizer(out: Path) -> Path:
    """A character-level tokenizer with ChatML special tokens (eos <|im_end|> = 1, the tiny models' eos) and the
    Qwen-style template above; 107 tokens, inside the tiny models' vocabulary of 256."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<|im_end|>", "<|im_start|>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    fast.chat_template = QWEN_STYLE_TEMPLATE
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer")))
