#!/usr/bin/env bash
# Builds the project's environment in .venv on a CPU machine of this kind (Python 3.11, no GPU).
# The one combination measured to hold Megatron-Core, SGLang, Ray and transformers together (see DESIGN.md):
# torch 2.14.1 + torchvision 0.29.1 (SGLang 0.5.23's pin; both lie on local disk, so pip downloads no CUDA wheels),
# megatron-core 0.16.1 (newest for Python 3.11), SGLang 0.5.23 without its CUDA-only packages.
# Idempotent: a second run only checks that everything is installed. Pip's cache is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install() {
  # This machine's pip config lists local indexes that lack most projects; pip warns once per such project.
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
# Torch first and pinned: anything that lets pip choose it freely downloads a multi-GB CUDA build.
pip_install torch==2.14.1 torchvision==0.29.1
# SGLang's own requirements minus CUDA-only packages (requirements/sglang-cpu.txt), then SGLang itself without deps.
pip_install -r requirements/sglang-cpu.txt
pip_install --no-deps sglang==0.5.23
# The package, its test extras, and the Megatron-Core release for this Python.
pip_install -e ".[test]" "megatron-core==0.16.1" torch==2.14.1 torchvision==0.29.1
"$VENV/bin/python" -W ignore -c "import torch, megatron.core, transformers, ray; print('env ok: torch', torch.__version__, \
'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
