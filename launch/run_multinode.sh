#!/usr/bin/env bash
# One node of a multi-node evaluation: torchrun with c10d rendezvous. Run it on every node,
# with the same NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID and arguments, and NODE_RANK 0..NNODES-1:
#
#   # node 0 (10.0.0.1) and node 1; the swarm's servers must be reachable from both
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch/run_multinode.sh --model /shared/my-llama \
#       --checkpoint /shared/ck.pt --data-files /shared/test.csv --output-dir /shared/results \
#       --backend petals --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... --dht-prefix my-llama
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./launch/run_multinode.sh ...the same arguments...
#
# NNODES (2)           nodes; the run starts once all of them joined
# NODE_RANK (0)        node 0 hosts the rendezvous store on MASTER_ADDR:MASTER_PORT, so run it on
#                      MASTER_ADDR. c10d numbers the ranks itself (nodes sorted by address), so
#                      torchrun's "node_rank ... will be ignored" warning on other nodes is expected.
# NPROC_PER_NODE (1)   ranks per node (gloo: any number, GPUs or not; --dist-backend nccl: at most one per GPU)
# OMP_NUM_THREADS      threads per rank (default: the CPUs this node's share holds, `nproc`, over the ranks;
#                      at least 1): under a scheduler's core confinement, each rank gets its own cores
# MASTER_ADDR          required: the address of node 0, reachable from every node
# MASTER_PORT          rendezvous TCP port on node 0 (default: one from RDZV_ID, 20000-29999, the same on
#                      every node: python -m dist_eval.rendezvous RDZV_ID)
# RDZV_ID (dist_eval)  a name for this run; two runs at once need different ones (their ports then differ)
# RDZV_TIMEOUT (600)   seconds to wait for every node to join
# LOCAL_ADDR           this node's address as the others reach it (default: its host name)
# PYTHON               interpreter (default: the repository's .venv, else python3)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"  # ROOT, PYTHON, PYTHONPATH
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (the same on every node), e.g. MASTER_ADDR=10.0.0.1}"
NODE_RANK="${NODE_RANK:-0}" NPROC="${NPROC_PER_NODE:-1}" RDZV_ID="${RDZV_ID:-dist_eval}"
IS_HOST=0
[[ "$NODE_RANK" == 0 ]] && IS_HOST=1
MASTER_PORT="${MASTER_PORT:-$("$PYTHON" -m dist_eval.rendezvous "$RDZV_ID")}"
if [[ -z "${OMP_NUM_THREADS:-}" && "$NPROC" =~ ^[0-9]+$ ]]; then  # torchrun's own default is 1
  THREADS=$(( $(nproc) / NPROC ))
  export OMP_NUM_THREADS=$(( THREADS > 0 ? THREADS : 1 ))
fi
# dist-eval (dist_eval/launcher.py): torchrun in-process, ending on the run's own error line
# and exit code (2: a usage error) instead of torchrun's 1 and its ChildFailedError report
exec "$PYTHON" -m dist_eval.launcher \
  --nnodes "${NNODES:-2}" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
  --rdzv-conf "is_host=$IS_HOST,join_timeout=${RDZV_TIMEOUT:-600}" \
  ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} \
  -- "$@"
