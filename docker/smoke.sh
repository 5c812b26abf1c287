#!/usr/bin/env bash
# The image's build and GPU smoke commands, in the order to run them (on a node with 2+ GPUs and Docker; each step
# needs the ones before it). Prints them; run them one by one and keep the output (docs/multi_node.md).
#   bash docker/smoke.sh [IMAGE]
set -euo pipefail
IMAGE=${1:-rlhf_mc:latest}
RUN="docker run --rm --gpus all --ipc=host --shm-size=16g $IMAGE"
GPU_TESTS="RLHF_MC_GPU_TESTS=1 python3 -m pytest -q -rs"
cat <<COMMANDS
# 1. build
docker build -t $IMAGE .
# 2. import check: the CUDA kernels of SGLang and Transformer Engine load against the image's torch
$RUN python3 -c "import torch, sgl_kernel, sglang, transformer_engine.pytorch, megatron.core, ray, rlhf_mc; print(torch.__version__, torch.cuda.device_count())"
# 3. the prepared GPU check: figures as JSON lines, then the GPU tests that need no SGLang or Transformer Engine
$RUN bash tools/gpu_check.sh
# 4. Transformer Engine's spec against the local spec: on 1 GPU, then on 2 (TP=2 with sequence parallelism)
docker run --rm --gpus '"device=0"' --ipc=host --shm-size=16g $IMAGE bash -c "$GPU_TESTS tests/gpu/test_transformer_engine.py"
docker run --rm --gpus '"device=0,1"' --ipc=host --shm-size=16g $IMAGE bash -c "$GPU_TESTS tests/gpu/test_transformer_engine.py"
# 5. one SGLang server with the memory saver: release frees its memory, resume restores it
$RUN bash -c "$GPU_TESTS tests/gpu/test_engine_gpu.py -k release"
# 6. colocated sync over CUDA IPC (an actor rank on the engine's GPU): engine log-probs equal the actor's
$RUN bash -c "$GPU_TESTS tests/gpu/test_engine_gpu.py -k cuda_ipc"
# 7. NCCL broadcast sync (the engine on GPU 1, the actor on GPU 0)
$RUN bash -c "$GPU_TESTS tests/gpu/test_engine_gpu.py -k nccl"
# 8. a tiny colocated trainer run on 2 GPUs, each GPU's memory logged every 2 s beside it (the tiny models' head_dim
#    is below what SGLang's default Hopper backend, fa3, takes: the triton backend)
$RUN bash -c "nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv -l 2 > runs/smoke_memory.csv & python3 tools/launch.py recipes/quickstart.yaml resources.device=cuda resources.devices_per_node=2 rollout.engine.mem_fraction_static=0.3 "rollout.engine.extra_args=[--attention-backend,triton]" trainer.total_steps=4 sft.steps=20 trainer.output_dir=runs/smoke; kill %1; cat runs/smoke_memory.csv"
# 9. the parallel layouts on NCCL: the training step at TP=2 across the GPUs
$RUN python3 tools/smoke_train.py --tp 2
# 10. two nodes: a head and a worker (docs/multi_node.md), then a disaggregated recipe across them
docker run -d --name rlhf_head --gpus all --network=host --ipc=host --shm-size=64g -e RAY_AUTH_MODE=disabled -v /shared:/shared $IMAGE head
docker run -d --name rlhf_worker --gpus all --network=host --ipc=host --shm-size=64g -e RAY_AUTH_MODE=disabled -v /shared:/shared $IMAGE worker HEAD_IP:6379
docker exec rlhf_head python3 tools/launch.py recipes/quickstart.yaml resources.device=cuda resources.nodes=2 resources.devices_per_node=1 rollout.placement=disaggregated rollout.engine.mem_fraction_static=0.5 "rollout.engine.extra_args=[--attention-backend,triton]" trainer.total_steps=4 trainer.output_dir=/shared/runs/two_nodes
COMMANDS
