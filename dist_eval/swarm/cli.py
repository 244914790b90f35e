"""``python -m dist_eval.swarm MODEL_DIR ...``: serve a model folder until Ctrl-C / SIGTERM, restarting
the servers that die (:mod:`dist_eval.swarm.supervisor`); ``python -m dist_eval.swarm status ...``:
list a swarm's blocks and servers (:mod:`dist_eval.swarm.status`).

The first argument ``status`` is the subcommand, never a folder: serve a model folder named
``status`` as ``./status``.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Optional, Sequence, Tuple

from dist_eval.swarm import teardown
from dist_eval.swarm.local import LocalSwarm
from dist_eval.swarm.placement import SwarmError
from dist_eval.swarm.status import OneLineParser
from dist_eval.swarm.supervisor import RestartPolicy

STATUS = "status"  # python -m dist_eval.swarm status ...: the subcommand (a folder of that name: ./status)


class _Interrupted(Exception):
    pass


_DESCRIPTION = (
    "Serve a saved model folder on a private Petals swarm on 127.0.0.1 (or, with --host and "
    "--initial-peers, as this host's part of a multi-host swarm) until Ctrl-C / SIGTERM. "
    "Prints INITIAL_PEERS=<multiaddrs> on stdout once its servers serve their blocks. A server that dies is "
    "restarted (one line on stderr per event); the swarm exits 1 once blocks stay unserved. "
    "`python -m dist_eval.swarm status --help`: list a swarm's blocks and servers."
)


def _build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m dist_eval.swarm", description=_DESCRIPTION)
    p.add_argument("model_dir", help="Folder saved with save_pretrained (config.json + weights); a folder named "
                   "'status' as ./status (the first argument 'status' is the status subcommand).")
    p.add_argument(
        "--servers",
        type=int,
        default=None,
        help="Server processes (default: 2 on the CPU; on GPUs as many per GPU as fit in half its memory, at most "
        "8), each with every block where they all fit in half the memory, else every block on 2 of them.",
    )
    p.add_argument(
        "--port", type=int, default=None, help="First TCP port (servers use PORT, PORT+1, ...; default: free ports)."
    )
    p.add_argument(
        "--dht-prefix", default=None, help="DHT prefix to announce the blocks under (default: dist_eval-<folder name>)."
    )
    p.add_argument(
        "--start-timeout", type=float, default=120.0, help="Seconds to wait for every block to be served (default 120)."
    )
    p.add_argument(
        "--blocks-per-server", type=int, default=None, help="Blocks per server (default: see --servers)."
    )
    p.add_argument(
        "--log-dir", default=None, help="Keep the servers' logs here (default: a temp folder removed at exit)."
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="IPv4 address to listen on and announce: this host's IP that "
        "the clients reach (default 127.0.0.1: this machine only).",
    )
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="Join the swarm at these multiaddrs (another host's INITIAL_PEERS=...) instead of starting a new one.",
    )
    p.add_argument(
        "--block-indices",
        type=_block_range_arg,
        default=None,
        metavar="A:B",
        help="Serve only blocks A..B-1 (end exclusive; other hosts serve the rest). Default: every block.",
    )
    p.add_argument(
        "--device", default="auto",
        help="Where the servers compute: auto (the default: every visible GPU if any, else the CPU), cpu, "
        "cuda (every visible GPU) or cuda:K.",
    )  # fmt: skip
    p.add_argument(
        "--torch-dtype", default=None, choices=["float32", "float16", "bfloat16"],
        help="The servers' dtype (default: float32 on the CPU; on a GPU the model's saved 16-bit dtype, else float16).",
    )  # fmt: skip
    _add_restart_flags(p)
    return p


def _add_restart_flags(p: argparse.ArgumentParser) -> None:
    d = RestartPolicy()
    g = p.add_argument_group("restarts (a server that dies)")
    g.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help=f"Restarts of one server within --restart-window; then it stays down (default "
                   f"{d.max_restarts}; 0: never restart). A server that exits with code 0 (SIGTERM) is not restarted.")
    g.add_argument("--restart-window", type=float, default=d.window, metavar="SECONDS",
                   help=f"The window --max-restarts counts in (default {d.window:.0f}).")
    g.add_argument("--restart-backoff", type=float, default=d.backoff, metavar="SECONDS",
                   help=f"Delay before a restart (default {d.backoff:g}), doubling with each restart in the window, "
                   f"at most {d.max_backoff:.0f} s, +-{d.jitter:.0%} at random.")
    g.add_argument("--unserved-timeout", type=float, default=d.unserved_timeout, metavar="SECONDS",
                   help=f"Exit 1 once a block has had no live server for this long (default "
                   f"{d.unserved_timeout:.0f}), or at once when every server holding it stays down.")


def _restart_policy(args: argparse.Namespace) -> RestartPolicy:
    flags = {"max_restarts": "--max-restarts", "window": "--restart-window", "backoff": "--restart-backoff",
             "unserved_timeout": "--unserved-timeout"}
    try:
        return RestartPolicy(max_restarts=args.max_restarts, window=args.restart_window,
                             backoff=args.restart_backoff, max_backoff=max(60.0, args.restart_backoff),
                             unserved_timeout=args.unserved_timeout)
    except SwarmError as e:
        for name, flag in flags.items():
            if str(e).startswith(f"{name}="):
                raise SwarmError(f"{flag} {str(e).split('=', 1)[1]}") from None
        raise


def _block_range_arg(text: str) -> Tuple[int, int]:
    start, sep, end = text.partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected A:B, e.g. 0:16 for blocks 0..15")
    return int(start), int(end)


def _say_ready(swarm: LocalSwarm) -> None:
    """What is served and how to evaluate against it on stderr, then the INITIAL_PEERS= line on
    stdout: whoever has read that line finds the summary already written.
    """
    peers = " ".join(swarm.initial_peers)
    placement = ", ".join(f"{a}:{b}" for a, b in swarm.placement)
    first, last = swarm.block_range
    blocks = (
        f"the {swarm.num_blocks} blocks"
        if (first, last) == (0, swarm.num_blocks)
        else f"blocks {first}:{last} (of {swarm.num_blocks})"
    )
    joined = f", joined to the swarm at {' '.join(swarm.join_peers)}" if swarm.join_peers else ""
    print(
        f"dist_eval.swarm: {swarm.num_servers} server(s) serve {blocks} of {swarm.model_dir}{joined} "
        f"(block ranges {placement}; ready in {swarm.start_seconds:.1f} s) under dht prefix {swarm.dht_prefix}. "
        f"Evaluate with: torchrun --nproc-per-node N -m dist_eval --backend petals --model {swarm.model_dir} "
        f"--data-files ... --initial-peers {peers} --dht-prefix {swarm.dht_prefix} . "
        "Ctrl-C or SIGTERM stops the swarm.",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    print(f"INITIAL_PEERS={peers}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [STATUS]:
        from dist_eval.swarm import status

        return status.main(argv[1:])
    args = _build_parser().parse_args(argv)

    def on_signal(signum, frame):
        # stop once; a second Ctrl-C must not interrupt the stopping itself
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise _Interrupted(signal.Signals(signum).name)

    try:
        swarm = LocalSwarm(
            args.model_dir, num_servers=args.servers, dht_prefix=args.dht_prefix, port=args.port,
            blocks_per_server=args.blocks_per_server, start_timeout=args.start_timeout, log_dir=args.log_dir,
            host=args.host, join_peers=args.initial_peers, block_range=args.block_indices,
            device=args.device, torch_dtype=args.torch_dtype, restart=_restart_policy(args),
        )  # fmt: skip
    except SwarmError as e:
        print(f"dist_eval.swarm: error: {e}", file=sys.stderr, flush=True)
        return 2
    # Installed before the servers start: they then begin with default signal handling
    # (even if this process was started with SIGINT ignored) and stop gracefully on SIGINT.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # terminal closed
    code = 0
    try:
        swarm.start()
        _say_ready(swarm)
        while True:
            time.sleep(0.5)
            swarm.check()
    except _Interrupted:
        code = 0
    except SwarmError as e:
        print(f"dist_eval.swarm: error: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        try:  # others may have joined this swarm: its servers finish their requests and say they are going
            swarm.stop(grace=None if swarm.join_peers else teardown.GRACE_SECONDS_ANNOUNCED, drain=True)
        except SwarmError as e:
            print(f"dist_eval.swarm: error: {e}", file=sys.stderr, flush=True)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
