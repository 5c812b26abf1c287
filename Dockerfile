# syntax=docker/dockerfile:1.7
# rlhf_mc on GPU nodes: NVIDIA's PyTorch image (CUDA, NCCL, torch, Transformer Engine, apex) plus SGLang,
# megatron-core, Ray and rlhf_mc at the versions pinned in requirements/docker.txt.
#
#   docker build -t rlhf_mc:latest .
#   docker run --gpus all --shm-size=32g --network=host -v /data:/data rlhf_mc:latest launch recipes/...yaml
#
# Entrypoint modes (docker/entrypoint.sh): head | worker HEAD_IP:PORT | launch RECIPE [key=value ...] | any command.
# Not built on the machines this repository is developed on (they have no Docker engine); see docs/multi_node.md.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.10-py3
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    TOKENIZERS_PARALLELISM=false

# Keep the base image's torch, Transformer Engine and apex: every install below is constrained to them.
COPY requirements/docker.txt /tmp/requirements-docker.txt
RUN pip freeze | grep -iE '^(torch|transformer[-_]engine|apex)==' > /etc/pip-base-constraints.txt \
    && pip install --constraint /etc/pip-base-constraints.txt -r /tmp/requirements-docker.txt \
    && useradd --create-home --uid 1000 --shell /bin/bash rlhf
WORKDIR /opt/rlhf_mc
COPY --chown=rlhf:rlhf pyproject.toml README.md ./
COPY --chown=rlhf:rlhf rlhf_mc ./rlhf_mc
COPY --chown=rlhf:rlhf tools ./tools
COPY --chown=rlhf:rlhf recipes ./recipes
COPY --chown=rlhf:rlhf model_configs ./model_configs
COPY --chown=rlhf:rlhf docker/entrypoint.sh /usr/local/bin/rlhf-entrypoint
RUN pip install --constraint /etc/pip-base-constraints.txt --no-deps -e . \
    && chmod 0755 /usr/local/bin/rlhf-entrypoint \
    && python -c "import rlhf_mc, megatron.core, sglang, ray, torch_memory_saver; print('rlhf_mc image ok')"

USER 1000
# Ray GCS, dashboard, client server; SGLang engines and torch.distributed pick free ports on the host network.
EXPOSE 6379 8265 10001
ENTRYPOINT ["/usr/local/bin/rlhf-entrypoint"]
CMD ["--help"]
