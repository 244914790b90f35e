"""Where a local swarm's servers go: block ranges, and the checks of a swarm's arguments.

Standard library only.
"""
from __future__ import annotations

import errno
import ipaddress
import json
import os
import re
import socket
from typing import List, Optional, Sequence, Tuple


class SwarmError(Exception):
    """The local swarm could not be started (or was misconfigured). The message is one
    line: what failed, what to do, and the tail of the failing server's log.
    """


# a peer to join: what the INITIAL_PEERS= line of a running swarm (or petals) prints
_PEER_RE = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/[^/\s]+/tcp/\d{1,5}/p2p/[1-9A-HJ-NP-Za-km-z]+$")


def _split(num_blocks: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous, near-equal ranges covering [0, num_blocks)."""
    return [(p * num_blocks // parts, (p + 1) * num_blocks // parts) for p in range(parts)]


def plan_blocks(num_blocks: int, num_servers: int, blocks_per_server: Optional[int] = None) -> List[Tuple[int, int]]:
    """Block range ``(start, end)`` (end exclusive) of each server.

    Default: one server serves everything. With two or more servers, every block is
    served by **two** servers, so that one server can fail without a block going
    missing: the servers form two layers, the first ``ceil(K/2)`` servers split the
    blocks into contiguous near-equal ranges, and so do the other ``floor(K/2)``
    (with more servers in a layer than blocks, ranges repeat). Each server then holds
    about ``2 * num_blocks / K`` blocks (twice the memory of a plain split; pass
    ``blocks_per_server=ceil(num_blocks / K)`` to give that up). For K=2 both servers
    serve every block; for K=3 and 4 blocks: 0:2, 2:4, 0:4; for K=4: 0:2, 2:4, 0:2, 2:4.

    ``blocks_per_server=B``: every server serves B contiguous blocks, the ranges evenly
    spread from block 0 to the last block (overlapping where K*B > num_blocks).
    SwarmError if they cannot cover every block (K*B < num_blocks).
    """
    if num_blocks < 1 or num_servers < 1:
        raise SwarmError(f"cannot place {num_blocks} block(s) on {num_servers} server(s).")
    if blocks_per_server is not None:
        if blocks_per_server < 1:
            raise SwarmError(f"blocks_per_server={blocks_per_server}: expected a positive number of blocks.")
        size = min(blocks_per_server, num_blocks)
        if size * num_servers < num_blocks:
            raise SwarmError(
                f"blocks_per_server={blocks_per_server} x {num_servers} server(s) cannot cover the model's "
                f"{num_blocks} blocks: use at least {-(-num_blocks // num_servers)} blocks per server or more servers."
            )
        if num_servers == 1:
            return [(0, size)]
        span = num_blocks - size
        starts = [(i * span + (num_servers - 1) // 2) // (num_servers - 1) for i in range(num_servers)]
        return [(s, s + size) for s in starts]
    if num_servers == 1:
        return [(0, num_blocks)]
    plan: List[Tuple[int, int]] = []
    for layer_size in ((num_servers + 1) // 2, num_servers // 2):
        ranges = _split(num_blocks, min(layer_size, num_blocks))
        plan.extend(ranges[i % len(ranges)] for i in range(layer_size))
    return plan


def _check_host(host: str) -> str:
    """``host`` if it is an IPv4 address servers can listen on *and* announce, else SwarmError."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise SwarmError(
            f"host={host!r}: expected an IPv4 address of this machine that the clients can reach "
            "(e.g. 10.0.0.5; `hostname -I` lists them), or 127.0.0.1 for a swarm on this machine only."
        ) from None
    if address.is_unspecified:
        # petals announces the address it listens on: 0.0.0.0 would be announced as-is
        raise SwarmError(
            f"host={host!r}: servers announce the address they listen on, and {host} is nobody's address; "
            "pass this machine's IP that the clients can reach (e.g. 10.0.0.5; `hostname -I` lists them)."
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise SwarmError(
                    f"host={host!r}: not an address of this machine; pass one of its own IPs "
                    "(`hostname -I` lists them), the one the clients can reach."
                ) from None
            raise
    return host


def _check_peers(peers: Sequence[str]) -> List[str]:
    peers = [str(p) for p in peers]
    for p in peers:
        if not _PEER_RE.match(p):
            raise SwarmError(
                f"initial peer {p!r}: expected a multiaddr like /ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... "
                "(a running swarm prints them on its INITIAL_PEERS=... line)."
            )
    return peers


def _check_block_range(block_range, num_blocks: int) -> Tuple[int, int]:
    try:
        start, end = (int(x) for x in block_range)
    except (TypeError, ValueError):
        start, end = -1, -1
    if not 0 <= start < end <= num_blocks:
        shown = ":".join(map(str, block_range)) if isinstance(block_range, (tuple, list)) else repr(block_range)
        raise SwarmError(
            f"block range {shown}: expected A:B (end exclusive) with 0 <= A < B <= {num_blocks}, "
            f"the model's number of blocks; e.g. 0:{num_blocks} for all of them."
        )
    return start, end


def _read_num_blocks(model_dir: str) -> int:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise SwarmError(f"{model_dir}: no config.json in the folder. Pass a folder saved with save_pretrained().")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SwarmError(f"{path}: not readable as JSON ({e}).") from None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and value >= 1:
            return value
    raise SwarmError(f"{path}: no positive num_hidden_layers; is this a transformer model petals can serve?")


def _default_prefix(model_dir: str) -> str:
    base = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    return "dist_eval-" + (re.sub(r"[^A-Za-z0-9_-]", "_", base) or "model")
