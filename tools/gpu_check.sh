#!/usr/bin/env bash
# The prepared GPU check: one command for a lent GPU machine (one GPU, Python 3.12, torch with CUDA, transformers;
# no SGLang, Ray, Transformer Engine or package registry there), under 10 minutes, printing JSON lines.
#
#   bash tools/gpu_check.sh --prepare      # here, with the registry: the wheels the GPU machine lacks -> build/gpu_wheels
#   bash tools/gpu_check.sh                # there (device tool: carry build/gpu_wheels)
#
# It runs our code on the Megatron-Core the Docker image pins (0.19.2) on CUDA + NCCL: bench/gpu_figures.py (matmul
# peak, train-step tokens/s and MFU for a 0.6B model, log-prob memory at long context, offload/reload and the memory
# it frees, the CUDA IPC handover of a flattened bucket vs a device-to-device copy, the RL log-prob pass and GRPO update
# vs transformers on length-sorted micro-batches: the GPU side of bench/ref_logprob.py and bench/grpo_step.py), then
# the GPU tests (tests/gpu: bf16 log-probs vs transformers, offload, IPC; the SGLang and Transformer Engine ones say
# why they skip where those are missing - in the Docker image they run). Without CUDA it prints one line saying so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu_wheels
MCORE=megatron-core==0.19.2
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$WHEELS"
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" "$MCORE"
  ls -la "$WHEELS"
  exit 0
fi
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo '{"check": "gpu", "skipped": "no CUDA device here"}'
  exit 0
fi
SITE=$(mktemp -d)
if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "$WHEELS"/megatron_core-*.whl || {
    echo '{"check": "gpu", "error": "megatron-core is missing: run tools/gpu_check.sh --prepare here and carry build/gpu_wheels"}'
    exit 1
  }
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import json, torch, megatron.core as m; print(json.dumps({'check': 'env', 'torch': torch.__version__,
'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(), 'gpus': torch.cuda.device_count(),
'megatron_core': m.__version__}))"
# The whole pytest log goes to $OUT (the device tool brings it back) or build/: a failure's traceback must not be
# lost to a tail (2026-12-04: one was).
LOG=${OUT:-build}/gpu_tests.log
mkdir -p "$(dirname "$LOG")"
status=0
timeout 290 "$PY" bench/gpu_figures.py || status=$?
RLHF_MC_GPU_TESTS=1 timeout 270 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rfEs --tb=short --durations=10 \
  > "$LOG" 2>&1
tests=$?
tail -40 "$LOG"
"$PY" - "$LOG" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text)}
print(json.dumps({"check": "tests/gpu", **counts, "log": sys.argv[1]}))
PY
exit $(( status || tests ))
