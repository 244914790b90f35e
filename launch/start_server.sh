#!/usr/bin/env bash
# Start this host's Petals server for MODEL_DIR; prints INITIAL_PEERS=<its address> once its
# blocks are served and stays in the foreground (Ctrl-C / SIGTERM stops it and its processes). A server
# that dies is restarted (--max-restarts, --restart-backoff, ...; docs/cluster.md#when-a-server-dies);
# `python -m dist_eval.swarm status --initial-peers ... --dht-prefix ...` lists what the swarm serves.
#
#   # host A (10.0.0.5): starts a new swarm, serving blocks 0..15 of a 32-block model
#   MODEL_DIR=/shared/my-llama DHT_PREFIX=my-llama BLOCKS=0:16 PORT=31337 ./launch/start_server.sh
#   #   -> INITIAL_PEERS=/ip4/10.0.0.5/tcp/31337/p2p/12D3KooW...
#   # host B: joins A's swarm, serving blocks 16..31
#   MODEL_DIR=/shared/my-llama DHT_PREFIX=my-llama BLOCKS=16:32 PORT=31337 \
#       INITIAL_PEERS=/ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... ./launch/start_server.sh
#
# MODEL_DIR       required: the model folder (save_pretrained) on this host
# DHT_PREFIX      the name the blocks are announced under: the same on every host and client
#                 (default dist_eval-<folder name>, which differs when the folders' names do)
# INITIAL_PEERS   multiaddrs of a running swarm to join (default: start a new swarm)
# BLOCKS          A:B, blocks A..B-1 (default: every block)
# HOST            the IPv4 address to listen on and announce, reachable from every client
#                 (default: this host's first address from `hostname -I`, else 127.0.0.1)
# PORT            TCP port (default: a free one); fix it to open it in a firewall
# SERVERS (1), DEVICE (auto: the GPUs if any, in fp16/bf16, else the CPU), PYTHON (the repository's
#                 .venv, else python3)
# Further arguments go to `python -m dist_eval.swarm` (its --help lists them).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"  # ROOT, PYTHON, PYTHONPATH
: "${MODEL_DIR:?set MODEL_DIR to the model folder to serve, e.g. MODEL_DIR=/shared/my-llama}"
if [[ -z "${HOST:-}" ]]; then
  HOST="$(hostname -I 2>/dev/null | awk '{print $1}')"
  HOST="${HOST:-127.0.0.1}"
fi
read -r -a PEERS <<< "${INITIAL_PEERS:-}"  # a space-separated list, as INITIAL_PEERS= prints it
exec "$PYTHON" -m dist_eval.swarm "$MODEL_DIR" --servers "${SERVERS:-1}" --host "$HOST" \
  ${PORT:+--port "$PORT"} ${BLOCKS:+--block-indices "$BLOCKS"} ${DHT_PREFIX:+--dht-prefix "$DHT_PREFIX"} \
  ${DEVICE:+--device "$DEVICE"} ${PEERS[@]+--initial-peers "${PEERS[@]}"} "$@"
