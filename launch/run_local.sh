#!/usr/bin/env bash
# Evaluate on this machine: torchrun with NPROC ranks; every argument goes to dist_eval.
#
#   ./launch/run_local.sh                                   # the built-in demo, 2 ranks
#   ./launch/run_local.sh --model ./my-llama --checkpoint ck.pt --data-files test.csv   # + a local swarm for the run
#   NPROC=4 ./launch/run_local.sh --model ./my-llama --checkpoint ck.pt --data-files test.csv \
#       --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... --dht-prefix my-llama      # an existing swarm
#
# NPROC   ranks on this machine (default 2)
# PYTHON  interpreter (default: the repository's .venv, else python3)
# The rendezvous is torchrun's --standalone one (a free local port), so runs never clash.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"  # ROOT, PYTHON, PYTHONPATH
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" -m dist_eval "$@"
