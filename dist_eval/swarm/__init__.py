"""Petals servers on this machine for one saved model folder: a private swarm, or this
host's share of a swarm that spans several hosts.

Library::

    with LocalSwarm("path/to/model", num_servers=2) as swarm:   # returns once every block is served
        ... from_pretrained(model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix)

Command line (stays in the foreground; Ctrl-C or SIGTERM stops every process it started)::

    python -m dist_eval.swarm MODEL_DIR [--servers K] [--port P] [--dht-prefix NAME] [--start-timeout S]
        [--host IP] [--initial-peers MADDR ...] [--block-indices A:B] [--device auto|cpu|cuda|cuda:K]
        [--torch-dtype float32|float16|bfloat16] [--max-restarts N] [--restart-window S] [--restart-backoff S]
        [--unserved-timeout S]
    python -m dist_eval.swarm status --initial-peers MADDR ... (--dht-prefix NAME | --model DIR) [--json]

It prints one line ``INITIAL_PEERS=<multiaddr> [<multiaddr> ...]`` on stdout once its
servers serve their blocks. Several hosts make one swarm: the first starts a new swarm
(``--host`` = its IP), the others join it with ``--initial-peers`` (the first's line),
each serving a ``--block-indices`` range, all under the same ``--dht-prefix``. A server that
dies is restarted (:mod:`~dist_eval.swarm.supervisor`); SIGTERM to one server drains it.

Each server is ``python -m dist_eval.swarm.server <petals run_server flags>`` (so it imports
petals through :mod:`dist_eval.backends.petals.shims`), started in its own session/process group: a
petals server spawns about eleven processes (among them the p2pd daemon that holds the
port), and only signalling the whole group stops them all. This package imports nothing
but the standard library, so the CLI starts at once and never prints petals' noise.

- :mod:`~dist_eval.swarm.devices`: where the servers run (CPU or GPUs), in which dtype, how many
- :mod:`~dist_eval.swarm.placement`: which blocks each server serves; checks of the arguments
- :mod:`~dist_eval.swarm.settings`: what a local swarm runs, decided before any server starts
- :mod:`~dist_eval.swarm.launch`: its work folder, its servers started in order, the wait until they serve
- :mod:`~dist_eval.swarm.local`: :class:`LocalSwarm` (settings, launch, supervisor, teardown, in that order)
- :mod:`~dist_eval.swarm.process`: one server process (start, state, stop, restart), as the swarm sees it
- :mod:`~dist_eval.swarm.state_file`: a server's state, told to the swarm that started it (not its log)
- :mod:`~dist_eval.swarm.teardown`: the servers stopped together, what they leave removed
- :mod:`~dist_eval.swarm.cli`: ``python -m dist_eval.swarm``
- :mod:`~dist_eval.swarm.supervisor`: dead servers restarted, with a backoff and a limit
- :mod:`~dist_eval.swarm.status`: ``python -m dist_eval.swarm status`` (imports petals: only that subcommand)
- :mod:`~dist_eval.swarm.server`: one server process, and the patches dist_eval's servers get
  (:func:`~dist_eval.swarm.server.apply_server_patches`)
- :mod:`~dist_eval.swarm.merged_forward`: a server's forward request as one task of its runtime
- :mod:`~dist_eval.swarm.wire`: the wire's server half: token ids in, read positions out
- :mod:`~dist_eval.swarm.blocks`: a server's blocks built knowing their index, read as released
"""
from dist_eval.swarm.cli import main
from dist_eval.swarm.local import LocalSwarm
from dist_eval.swarm.placement import SwarmError, plan_blocks

__all__ = ["SwarmError", "LocalSwarm", "plan_blocks", "main"]
