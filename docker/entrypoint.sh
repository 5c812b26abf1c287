#!/usr/bin/env bash
# Entrypoint of the rlhf_mc image.
#   head [ray start options]                 start a Ray head on this node and stay in the foreground
#   worker HEAD_IP:PORT [ray start options]  join the cluster at HEAD_IP:PORT and stay in the foreground
#   launch RECIPE [key=value ...] [--dry-run] [--address ...]   run tools/launch.py
#   --help                                   this text
#   anything else                            run it as a command
set -euo pipefail
GPUS=${RAY_NUM_GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
case "${1:---help}" in
  head)
    shift
    exec ray start --head --port="${RAY_PORT:-6379}" --dashboard-host=0.0.0.0 --num-gpus="$GPUS" --block "$@"
    ;;
  worker)
    shift
    address=${1:?usage: worker HEAD_IP:PORT}
    shift
    exec ray start --address="$address" --num-gpus="$GPUS" --block "$@"
    ;;
  launch)
    shift
    exec python /opt/rlhf_mc/tools/launch.py "$@"
    ;;
  --help|-h)
    sed -n '2,7p' "$0"
    ;;
  *)
    exec "$@"
    ;;
esac
