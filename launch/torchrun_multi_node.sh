#!/usr/bin/env bash
# Several nodes: run this on every node. Node 0 becomes the controller; the others run node agents
# that spawn the workers the controller's placement plan assigns to them.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun_multi_node.sh --config cfg.yaml
# or: launch/torchrun_multi_node.sh NNODES NODE_RANK MASTER_ADDR --config cfg.yaml
set -euo pipefail
if [[ $# -ge 3 && "$1" =~ ^[0-9]+$ && "$2" =~ ^[0-9]+$ ]]; then
    NNODES="$1"; NODE_RANK="$2"; MASTER_ADDR="$3"; shift 3
fi
: "${NNODES:?set NNODES (or pass NNODES NODE_RANK MASTER_ADDR first)}"
: "${NODE_RANK:?set NODE_RANK}"
: "${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT="${MASTER_PORT:-29500}"
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node 1 \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m miles.launch -- "$@"
