# syntax=docker/dockerfile:1.7
# rlhf_mc on GPU nodes: SGLang's release image for the pinned SGLang (Ubuntu 24.04, Python 3.12, CUDA 13.0, torch
# 2.14.1, torch_memory_saver: the torch SGLang's kernels are built against), plus Transformer Engine built against
# that torch, megatron-core, Ray and rlhf_mc at the versions pinned in requirements/docker.txt, as slime and verl
# build theirs. (NVIDIA's PyTorch images carry pre-release torch builds under a global pip constraint: SGLang's
# torch==2.14.1 cannot be installed there, and sgl_kernel does not import against their torch.)
#
#   docker build -t rlhf_mc:latest .
#   bash docker/smoke.sh        # prints the build and GPU smoke commands, in order
#
# Entrypoint modes (docker/entrypoint.sh): head | worker HEAD_IP:PORT | launch RECIPE [key=value ...] | any command.
# Not built on the machines this repository is developed on (they have no Docker engine); see docs/multi_node.md.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23-cu130
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    TOKENIZERS_PARALLELISM=false

# The base's torch stack stays: every install below is constrained to it. Its SGLang (installed from its source
# tree) is the pinned one: checked here, not reinstalled.
RUN pip freeze | grep -iE '^(torch|torchvision|torchaudio|triton)==' > /etc/pip-base-constraints.txt \
    && python3 -c "import importlib.metadata as m; v = m.version('sglang'), m.version('torch'); \
assert v[0] == '0.5.23' and v[1].startswith('2.14.1'), v"

# Transformer Engine from source, against the base's torch and CUDA (PyPI's CUDA 13 wheel is built against a newer
# cuBLAS than CUDA 13.0's: undefined symbols at import); 2.17.1 is the release megatron-core 0.19 pins. No apex: the
# model config turns off the fusions that would use it (gradient_accumulation_fusion, persist_layer_norm).
ARG TE_VERSION=2.17.1
ARG NVTE_CUDA_ARCHS="90;100"
RUN NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS}" MAX_JOBS=16 \
    pip install --constraint /etc/pip-base-constraints.txt --no-build-isolation \
        "transformer_engine @ git+https://github.com/NVIDIA/TransformerEngine.git@v${TE_VERSION}" \
        onnx==1.23.2 onnxscript==0.7.2

COPY requirements/docker.txt /tmp/requirements-docker.txt
RUN pip install --constraint /etc/pip-base-constraints.txt -r /tmp/requirements-docker.txt

# The image runs as uid 1000: Ubuntu 24.04's `ubuntu` user (created where a base lacks it). It owns the repository
# folder, so a launch can make its run folder there (runs/ by default); tests/ and bench/ are in the image, so
# tools/gpu_check.sh and the GPU tests run without a mount.
WORKDIR /opt/rlhf_mc
COPY --chown=1000:1000 . .
RUN (id -u 1000 >/dev/null 2>&1 || useradd --create-home --uid 1000 --shell /bin/bash rlhf) \
    && pip install --constraint /etc/pip-base-constraints.txt --no-deps -e . \
    && mkdir -p runs && chown 1000:1000 /opt/rlhf_mc runs \
    && install -m 0755 docker/entrypoint.sh /usr/local/bin/rlhf-entrypoint \
    && python3 -c "import rlhf_mc, megatron.core, ray, yaml; print('rlhf_mc image ok')"

USER 1000
# Ray GCS, dashboard, client server; SGLang engines and torch.distributed pick free ports on the host network.
EXPOSE 6379 8265 10001
ENTRYPOINT ["/usr/local/bin/rlhf-entrypoint"]
CMD ["--help"]
