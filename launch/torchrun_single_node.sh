#!/usr/bin/env bash
# One node: torchrun starts one launcher process; it becomes the controller and spawns every worker.
#   launch/torchrun_single_node.sh --config launch/configs/demo_cpu.yaml [--flag value ...]
set -euo pipefail
MASTER_PORT="${MASTER_PORT:-29500}"
exec torchrun --nnodes 1 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$MASTER_PORT" \
    -m miles.launch -- "$@"
