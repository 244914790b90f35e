"""``python -m dist_eval.swarm status --initial-peers MADDR ... [--dht-prefix P]``: which blocks
of a swarm are served, by whom, read from the swarm's DHT as petals' (retired) health monitor
did: a client-mode DHT joins through the given peers, reads every block's server records
(``petals.utils.dht.get_remote_module_infos``), and dials each server (its address, and
whether it answers).

A block is served when a server announces it ONLINE and answers a dial (a server killed
outright stays announced ONLINE until its record expires). Exit status: 0 when every block is
served, 1 when a block is not, 2 on bad flags or when no peer answers. ``--json`` prints one
JSON object instead of the table. With ``--model``, each server's line also says how much its
blocks weigh in the dtype it announces, by each block's own shapes (config.json: a mixture-of-experts
block weighs many dense ones; :func:`dist_eval.swarm.placement.block_parameters`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from functools import partial
from typing import Dict, List, Optional, Sequence

from dist_eval.errors import printable
from dist_eval.procs import remove_dead_hivemind_sockets
from dist_eval.swarm.placement import SwarmError, block_parameters, check_peers, default_prefix, read_num_blocks

_PROBE_SECONDS = 5.0  # a server that does not answer a dial within this is listed unreachable
_FIRST_LOOKUP = 64  # blocks read at first when the block count is not given


class OneLineParser(argparse.ArgumentParser):
    """The swarm commands' parser: an error is one line, without the usage block."""

    def error(self, message: str) -> None:
        print(f"{self.prog.removeprefix('python -m ')}: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m dist_eval.swarm status",
        description="List a swarm's blocks with the servers that hold them (address, dtype, throughput, version, "
        "state) and the blocks with none, read from its DHT. Exits 1 when a block has no server that is ONLINE and "
        "answers, 2 when no peer answers.",
    )
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                   help="Any live server's multiaddr (several: any of them may be down).")
    p.add_argument("--dht-prefix", default=None,
                   help="The prefix the blocks are announced under (default: that of --model's folder).")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="The model folder: its block count (else the highest block any server announces) and "
                   "default prefix.")
    p.add_argument("--num-blocks", type=int, default=None, help="The model's block count (default: see --model).")
    p.add_argument("--json", action="store_true", help="One JSON object on stdout instead of the table.")
    p.add_argument("--timeout", type=float, default=30.0, help="Seconds to join the swarm and read it (default 30).")
    return p


def _dial_all(dht, node, peer_ids: Sequence) -> Dict[str, List[str]]:
    """(run inside the DHT's process) {peer id: its multiaddrs} of the servers that answer a dial."""
    async def dial(peer_id) -> None:
        try:
            await asyncio.wait_for(node.p2p._client.connect(peer_id, []), _PROBE_SECONDS)
        except Exception:  # unreachable: left out
            pass

    async def run() -> Dict[str, List[str]]:
        await asyncio.gather(*(dial(p) for p in peer_ids))
        answered = {str(p) for p in peer_ids}
        return {str(i.peer_id): [str(a) for a in i.addrs] for i in await node.p2p.list_peers()
                if str(i.peer_id) in answered}

    return run()


def read_swarm(peers: Sequence[str], prefix: str, num_blocks: Optional[int], timeout: float) -> dict:
    """The swarm's blocks and servers as one dict (what ``--json`` prints)."""
    from dist_eval.backends.compat import quiet_third_party_output
    from dist_eval.backends.petals.shims import import_petals

    quiet_third_party_output()
    import_petals()
    import hivemind
    from petals.utils.dht import get_remote_module_infos

    started = time.time()
    try:
        dht = hivemind.DHT(initial_peers=list(peers), client_mode=True, start=True, startup_timeout=timeout)
    except Exception as e:
        remove_dead_hivemind_sockets(started)  # the failed p2pd's, which hivemind leaves
        raise SwarmError(f"--initial-peers: no peer answered at {' '.join(peers)} ({type(e).__name__}: {e}). "
                         "Pass the address of a live server (its INITIAL_PEERS=... line).") from None
    try:
        count = num_blocks or _FIRST_LOOKUP
        infos = get_remote_module_infos(dht, [f"{prefix}.{i}" for i in range(count)], latest=True)
        guessed = num_blocks is None
        if guessed:  # the blocks up to the last one any server announces
            count = max([s.end_block for i in infos for s in i.servers.values() if s.end_block] + [0])
            if count > len(infos):
                infos = get_remote_module_infos(dht, [f"{prefix}.{i}" for i in range(count)], latest=True)
            infos = infos[:count]
        peer_ids = sorted({p for i in infos for p in i.servers}, key=str)
        addresses = dht.run_coroutine(partial(_dial_all, peer_ids=peer_ids)) if peer_ids else {}
    finally:
        dht.shutdown()
    return _as_dict(prefix, infos, addresses, guessed)


def _as_dict(prefix: str, infos, addresses: Dict[str, List[str]], guessed: bool) -> dict:
    servers: Dict[str, dict] = {}
    blocks = []
    for index, info in enumerate(infos):
        for peer_id, s in info.servers.items():
            servers.setdefault(str(peer_id), {
                "peer_id": str(peer_id), "addresses": addresses.get(str(peer_id), []),
                "reachable": str(peer_id) in addresses, "state": s.state.name, "blocks": [s.start_block, s.end_block],
                "torch_dtype": str(s.torch_dtype), "quant_type": str(s.quant_type), "throughput": s.throughput,
                "version": s.version, "public_name": s.public_name,
            })  # fmt: skip
        online = sorted(str(p) for p, s in info.servers.items() if s.state.name == "ONLINE" and str(p) in addresses)
        blocks.append({"block": index, "servers": sorted(str(p) for p in info.servers), "online": online})
    unserved = [b["block"] for b in blocks if not b["online"]]
    return {"dht_prefix": prefix, "num_blocks": len(blocks), "num_blocks_from": "announced" if guessed else "given",
            "servers": sorted(servers.values(), key=lambda s: (s["blocks"], s["peer_id"])),
            "blocks": blocks, "unserved": unserved, "healthy": bool(blocks) and not unserved}


_VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def model_block_parameters(model_dir: str) -> Optional[List[int]]:
    """Each block's number of weights by the folder's config.json (placement.block_parameters); None
    where it cannot say (no config.json, a family it does not count).
    """
    from dist_eval.backends.config_json import read_config_json
    from dist_eval.errors import UsageError

    try:
        return block_parameters(read_config_json(model_dir))
    except (UsageError, KeyError, TypeError, AttributeError, SwarmError):
        return None


def add_sizes(status: dict, parameters: List[int]) -> dict:
    """``status`` with each block's weights (``block_parameters``) and each server's ``weight_bytes``:
    its blocks' weights in the dtype it announces (None where its range is not the model's).
    """
    status["block_parameters"] = list(parameters)
    for server in status["servers"]:
        first, last = server["blocks"]
        value = _VALUE_BYTES.get(server["torch_dtype"].replace("torch.", ""), 4)
        inside = isinstance(first, int) and isinstance(last, int) and 0 <= first < last <= len(parameters)
        server["weight_bytes"] = sum(parameters[first:last]) * value if inside else None
    return status


def _size(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count / 2**10:.1f} KiB"


def render(status: dict) -> str:
    """The table: the servers, then each range of blocks with the same servers."""
    lines = [f"dht prefix {status['dht_prefix']}: {status['num_blocks']} block(s)"
             + (" (the highest any server announces)" if status["num_blocks_from"] == "announced" else "")
             + f", {len(status['servers'])} server(s)"]
    tags = {s["peer_id"]: f"S{i}" for i, s in enumerate(status["servers"])}
    for s in status["servers"]:
        address = s["addresses"][0] + f"/p2p/{s['peer_id']}" if s["addresses"] else s["peer_id"]
        size = f" ({_size(s['weight_bytes'])})" if s.get("weight_bytes") is not None else ""
        lines.append(f"  {tags[s['peer_id']]}  {s['state']:<7}  blocks {s['blocks'][0]}:{s['blocks'][1]}{size}  "
                     f"{s['torch_dtype'].replace('torch.', '')}  throughput {s['throughput']:g}  "
                     f"petals {s['version']}  {'reachable' if s['reachable'] else 'UNREACHABLE'}  {address}")
    for first, last, block in _runs(status["blocks"]):
        holders = ", ".join(f"{tags[p]}" + ("" if p in block["online"] else " (not serving)")
                            for p in block["servers"])
        lines.append(f"blocks {first}:{last}: " + (holders if block["online"] else f"NO SERVER ({holders or 'none'})"))
    if status["unserved"]:
        lines.append(f"unserved: blocks {', '.join(map(str, status['unserved']))}")
    else:
        lines.append("every block is served" if status["blocks"] else "no block is announced under this prefix")
    return "\n".join(map(printable, lines))  # the servers' versions, dtypes, addresses: what they announce


def _runs(blocks: List[dict]):
    """(first, end, block) of each run of consecutive blocks with the same servers and states."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or (blocks[i]["servers"], blocks[i]["online"]) != (
                blocks[start]["servers"], blocks[start]["online"]):
            yield start, i, blocks[start]
            start = i


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        peers = check_peers(args.initial_peers)
        num_blocks = args.num_blocks
        if args.model is not None:
            if not os.path.isdir(args.model):
                raise SwarmError(f"--model {args.model}: no such folder; pass the model folder, or --num-blocks.")
            num_blocks = num_blocks or read_num_blocks(args.model)
        if num_blocks is not None and num_blocks < 1:
            raise SwarmError(f"--num-blocks {num_blocks}: expected a positive number of blocks.")
        prefix = args.dht_prefix or (default_prefix(os.path.abspath(args.model)) if args.model else None)
        if prefix is None:
            raise SwarmError("--dht-prefix: required without --model (the prefix the servers announce their "
                             "blocks under, e.g. --dht-prefix my-llama).")
        status = read_swarm(peers, prefix, num_blocks, args.timeout)
        parameters = model_block_parameters(args.model) if args.model is not None else None
        if parameters is not None and len(parameters) == status["num_blocks"]:
            add_sizes(status, parameters)  # each server's share by its blocks' real sizes
    except SwarmError as e:
        print(f"dist_eval.swarm status: error: {printable(e)}", file=sys.stderr, flush=True)  # a peer's words, maybe
        return 2
    print(json.dumps(status) if args.json else render(status), flush=True)
    return 0 if status["healthy"] else 1
