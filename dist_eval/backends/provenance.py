"""Which servers served a petals run, as they announce themselves in the DHT.

Read from the client's routing table (``sequence_manager.state.sequence_info.block_infos``:
one ``RemoteModuleInfo`` per block, ``servers`` mapping each peer id to petals'
``ServerInfo``). On a swarm that dist_eval did not start, replicas of a block may differ
(petals servers default to NF4 quantization on CUDA and to ``torch_dtype="auto"``) and
petals picks a route at random for each forward: the results are then reproducible only
when every block's replicas are identical, which :func:`swarm_provenance` says.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

from dist_eval.backends.blocks import SERVER_VERSION_MARK

# What decides a server's numbers: two replicas that agree on these compute the same blocks
REPLICA_FIELDS = ("version", "torch_dtype", "quant_type", "adapters")


def _state_name(info) -> str:
    state = getattr(info, "state", None)
    return str(getattr(state, "name", state)).lower()


def _text(info, name: str):
    value = getattr(info, name, None)
    return None if value is None else str(value)


def _replica_value(info, name: str) -> str:
    value = str(getattr(info, name, None))
    # dist_eval's servers mark their version (backends.blocks): on a model both compute, the same blocks
    return value[: -len(SERVER_VERSION_MARK)] if name == "version" and value.endswith(SERVER_VERSION_MARK) else value


def _server_record(peer_id: str, info, blocks: List[int]) -> dict:
    return {
        "peer_id": peer_id,
        "public_name": _text(info, "public_name"),
        "blocks": [min(blocks), max(blocks) + 1],  # [start, end) of what it served of this model
        "state": _state_name(info),
        "petals_version": _text(info, "version"),
        "torch_dtype": _text(info, "torch_dtype"),
        "quantization": _text(info, "quant_type"),
        "adapters": [str(a) for a in getattr(info, "adapters", None) or []],
    }


def swarm_provenance(block_infos: Iterable) -> dict:
    """{servers: [...], identical_replicas: bool, mixed_blocks: [block indices]} of the
    online servers of each block (``block_infos`` in block order).
    """
    blocks_of: Dict[str, List[int]] = {}
    infos: Dict[str, object] = {}
    mixed: List[int] = []
    for index, block in enumerate(block_infos):
        kinds = set()
        for peer_id, info in (getattr(block, "servers", None) or {}).items():
            if _state_name(info) != "online":
                continue
            key = str(peer_id)
            blocks_of.setdefault(key, []).append(index)
            infos[key] = info
            kinds.add(tuple(_replica_value(info, f) for f in REPLICA_FIELDS))
        if len(kinds) > 1:
            mixed.append(index)
    servers = [_server_record(p, infos[p], blocks_of[p]) for p in sorted(blocks_of, key=lambda p: blocks_of[p][0])]
    return {"servers": servers, "identical_replicas": not mixed, "mixed_blocks": mixed}


def servers_without_block_options(block_infos: Iterable) -> list:
    """(peer id, announced version) of the online servers that are not dist_eval's: their
    version lacks :data:`~dist_eval.backends.blocks.SERVER_VERSION_MARK`, so they do not
    compute the block options of a newer family.
    """
    return [(s["peer_id"], s["petals_version"]) for s in swarm_provenance(block_infos)["servers"]
            if not str(s["petals_version"]).endswith(SERVER_VERSION_MARK)]


def replicas_warning(run: dict) -> str:
    """One line for the summary when some block's replicas differed, else ''."""
    swarm = run.get("swarm") or {}
    if swarm.get("identical_replicas", True):
        return ""
    blocks = swarm.get("mixed_blocks", [])
    return (f"  warning: blocks {blocks[:8]}{' ...' if len(blocks) > 8 else ''} were served by replicas that differ "
            "(petals version, dtype, quantization or adapters): results may depend on the route "
            "(metrics.json run.swarm)")
