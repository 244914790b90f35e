"""The rendezvous port of a multi-node run, taken from the run itself (the standard library only).

    python -m dist_eval.rendezvous RDZV_ID          # the port every node of run RDZV_ID computes
    python -m dist_eval.rendezvous RDZV_ID --free   # from there, the first port free on this host

A fixed port (torchrun's 29500) makes a second job whose first node already hosts one fail
at its rendezvous (``EADDRINUSE``); on a cluster, jobs sharing nodes are the norm. The port
is a function of the run's id, so that every node finds the same one without talking to the
others: a SLURM job id (consecutive jobs get consecutive ports) or any name
(``launch/run_multinode.sh``'s ``RDZV_ID``: runs with different names get different ports,
as a rule). ``--free`` is for the one process that runs on the rendezvous host before the
nodes start (``launch/slurm.sbatch``'s batch step): it moves on past ports already taken
there and hands the result to every node. ``MASTER_PORT`` set by hand overrides both.
"""
from __future__ import annotations

import socket
import sys
import zlib
from typing import List, Optional

# Below Linux's ephemeral range (32768-60999), where the OS picks the ports of outgoing
# connections and of listeners asking for port 0 (gloo's, the store's).
PORT_BASE = 20000
PORT_SPAN = 10000


def port_for(rdzv_id: str) -> int:
    """The port of run ``rdzv_id``: a number's (a job id) remainder, else a CRC-32 of the name."""
    rdzv_id = str(rdzv_id).strip()
    key = int(rdzv_id) if rdzv_id.isdigit() else zlib.crc32(rdzv_id.encode("utf-8"))
    return PORT_BASE + key % PORT_SPAN


def port_is_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every address of this host now (as the
    rendezvous store does), in IPv4 and, where there is one, IPv6.
    """
    for family, address in ((socket.AF_INET, ("", port)), (socket.AF_INET6, ("::", port))):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is no obstacle
            try:
                s.bind(address)
                s.listen(1)
            except OSError:
                return False
    return True


def first_free_port(port: int, tries: int = 100) -> int:
    """``port`` or the next one free on this host, within the range (wrapping around)."""
    for step in range(tries):
        candidate = PORT_BASE + (port - PORT_BASE + step) % PORT_SPAN
        if port_is_free(candidate):
            return candidate
    raise OSError(f"no free port among the {tries} from {port}: set MASTER_PORT")


def build_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dist_eval.rendezvous",
                                     description="The rendezvous port of run RDZV_ID (the same on every node).")
    parser.add_argument("rdzv_id", metavar="RDZV_ID", help="the run's id: a SLURM job id or any name")
    parser.add_argument("--free", action="store_true",
                        help="from there, the first port free on this host (run on the rendezvous host)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its usage line
        return int(e.code or 0)
    if not args.rdzv_id.strip():
        print("dist_eval.rendezvous: error: RDZV_ID: expected a job id or a name, got an empty one", file=sys.stderr)
        return 2
    port = port_for(args.rdzv_id)
    try:
        print(first_free_port(port) if args.free else port)
    except OSError as e:
        print(f"dist_eval.rendezvous: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
