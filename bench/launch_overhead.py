"""Two fixed costs of every run, each in fresh processes (both are paid once per process), ours against the path we
replaced, alternated over --rounds:

- a rank's first checkpoint save (the quickstart's model with its optimizer, one gloo rank): models/checkpoint.py's
  save_model against Megatron's own dist_checkpointing.save of the same state, whose writer serves its results
  through a multiprocessing Manager started at a process's first save;
- the driver reading a rank's first log-probs through Ray (a local instance; the rank has megatron-core imported, as
  every rank has): tensors as bytes (runtime/ray_tensors.py) against torch's pickling, which names megatron-core's
  storage loader, so that the driver imports megatron-core to read them.

Prints JSON lines: the medians and the ratios.

    .venv/bin/python bench/launch_overhead.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402

SAVE = """
import json, shutil, sys, tempfile, time
from pathlib import Path
import torch
from rlhf_mc.config import ModelConfig, OptimizerConfig, ParallelConfig
from rlhf_mc.models import checkpoint
from rlhf_mc.models.gpt import build_model
from rlhf_mc.optim import setup_training
from rlhf_mc.runtime import init_distributed, init_parallel
from rlhf_mc.runtime.spawn import free_port
import os
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
init_distributed()
init_parallel(ParallelConfig(), seed=0)
chunks = build_model(ModelConfig.from_yaml("model_configs/tiny-arith.yaml"), ParallelConfig())
state = setup_training(chunks, OptimizerConfig())
checkpoint._fill_fresh_optimizer_state(state.optimizer)
out = Path(tempfile.mkdtemp()) / "ckpt"
start = time.perf_counter()
if sys.argv[1] == "ours":
    checkpoint.save_model(chunks, out, optimizer=state.optimizer)
else:
    from megatron.core import dist_checkpointing
    out.mkdir()
    dist_checkpointing.save(checkpoint._state(chunks, state.optimizer, is_loading=False), str(out))
print(json.dumps({"seconds": time.perf_counter() - start}))
shutil.rmtree(out.parent)
"""

READ = """
import json, sys, time, types
import ray, ray.util, torch
from rlhf_mc.trainer.placement import start_ray

@ray.remote
class Rank:
    def __init__(self, as_bytes):
        import megatron.core  # every rank has it
        if as_bytes:
            from rlhf_mc.runtime import ray_tensors
            ray_tensors.register()

    def logprobs(self):
        return {"logprobs": torch.randn(4096)}

start_ray(None, types.SimpleNamespace(device="cpu", devices=1))
if sys.argv[1] == "torch":  # the driver's registration undone: torch's own pickling both ways
    ray.util.deregister_serializer(torch.Tensor)
rank = Rank.remote(sys.argv[1] == "ours")
ray.get(rank.__ray_ready__.remote())
start = time.perf_counter()
ray.get(rank.logprobs.remote())
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "megatron_in_driver": "megatron" in sys.modules}))
ray.shutdown()
"""


def _run(script: str, variant: str) -> dict:
    result = subprocess.run([sys.executable, "-c", script, variant], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for figure, script, ours, baseline, name in (
            ("first checkpoint save of a rank", SAVE, "ours", "megatron", "megatron.core.dist_checkpointing.save"),
            ("driver reads a rank's first tensors through Ray", READ, "ours", "torch",
             "torch's pickling (the driver imports megatron-core)")):
        times = {ours: [], baseline: []}
        for _ in range(args.rounds):
            for variant in (ours, baseline):
                times[variant].append(_run(script, variant)["seconds"])
        ours_s, base_s = statistics.median(times[ours]), statistics.median(times[baseline])
        emit(figure=figure, value=round(ours_s, 3), baseline=name, baseline_s=round(base_s, 3),
             ratio_baseline_over_ours=round(base_s / ours_s, 1), rounds=args.rounds)


if __name__ == "__main__":
    main()
