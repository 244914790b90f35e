"""The store's files on disk: a row file (:func:`write_file`, :func:`read_rows`: header, checksum, rows; read only
when this user can trust it), a key folder's row files in order, its ``.blamed`` files.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from dist_eval.atomic import atomic_write, read_regular
from dist_eval.rowstore.keys import KEY_BYTES

MAGIC = b"DIST_EVAL_ROWS\x00"


FORMAT_VERSION = 1


SUFFIX = ".rows"


BLAMED_SUFFIX = ".blamed"  # a run's blamed servers: their rows are not served


# A row file's size bound (a reader never reads more): a flush of a rank's rows every save interval
# is far smaller (1M rows of 1000 classes, 4 GB, would be one flush of hours of a swarm's work)
MAX_FILE_BYTES = 4 << 30


def blamed_servers(folder: str) -> set:
    """The servers the ``.blamed`` files of a key's folder name (those this user can trust: its own
    regular files): no row of theirs is served.
    """
    try:
        names = [n for n in os.listdir(folder) if n.endswith(BLAMED_SUFFIX) and not n.startswith(".")]
    except OSError:
        return set()
    blamed: set = set()
    for name in names:
        try:
            facts = json.loads(read_regular(os.path.join(folder, name), 1 << 20, owner=os.geteuid()))
            blamed.update(str(peer) for peer in facts["blamed"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not whole, or not this user's: names no server
    return blamed


def row_files(folder: str) -> List[str]:
    """The row files of a key's folder, oldest first (by modification time, then name): the order
    in which a later copy of a row replaces an earlier one. Hidden names (writes in progress) aside.
    """
    try:
        names = [n for n in os.listdir(folder) if n.endswith(SUFFIX) and not n.startswith(".")]
    except OSError:
        return []
    dated = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            dated.append((os.lstat(path).st_mtime_ns, name, path))
        except OSError:  # removed meanwhile
            continue
    return [path for _, _, path in sorted(dated)]


def _payload(keys: np.ndarray, logits: np.ndarray, seconds: np.ndarray) -> bytes:
    return (np.ascontiguousarray(keys, dtype=np.uint8).tobytes() + np.ascontiguousarray(logits, "<f4").tobytes()
            + np.ascontiguousarray(seconds, "<f4").tobytes())


def _servers_facts(servers: Optional[List[tuple]]) -> Optional[dict]:
    """The header's ``servers``: the distinct sets of servers, and each row's (an index); None when
    no row came from a swarm's servers.
    """
    if not servers or not any(servers):
        return None
    sets: Dict[tuple, int] = {}
    rows = [sets.setdefault(tuple(sorted(s)), len(sets)) for s in servers]
    return {"sets": [list(s) for s in sets], "rows": rows}


def _checksum(payload, servers: Optional[dict]) -> str:
    """The rows' SHA-256, and their servers' where they have some (a row's provenance is checked as its logits are)."""
    digest = hashlib.sha256(payload)
    if servers is not None:
        digest.update(json.dumps(servers, sort_keys=True).encode())
    return digest.hexdigest()


def write_file(path: str, key: str, keys: np.ndarray, logits: np.ndarray, seconds: np.ndarray,
               servers: Optional[List[tuple]] = None) -> None:
    """One file of rows: MAGIC, header length (8 bytes), the JSON header, the rows; written
    atomically (:func:`~dist_eval.atomic.atomic_write`: a killed writer leaves no file of this name).
    ``servers``: each row's swarm servers (the header's ``servers``), or None.
    """
    payload = _payload(keys, logits, seconds)
    facts = _servers_facts(servers)
    header = {"format": FORMAT_VERSION, "key": key, "rows": int(len(keys)), "num_labels": int(logits.shape[1]),
              "sha256": _checksum(payload, facts)}
    if facts is not None:
        header["servers"] = facts
    header = json.dumps(header).encode()
    atomic_write(path, MAGIC + len(header).to_bytes(8, "little") + header + payload)


def read_file(path: str, key: str, num_labels: Optional[int]) -> Tuple[List[bytes], np.ndarray, np.ndarray]:
    """(row keys, logits [n, K], seconds [n]) of a file of ``key``, as :func:`read_rows`."""
    return read_rows(path, key, num_labels)[:3]


def read_rows(path: str, key: str, num_labels: Optional[int]) -> Tuple[List[bytes], np.ndarray, np.ndarray, list]:
    """(row keys, logits [n, K], seconds [n], each row's servers: a tuple of peer ids, () where no
    swarm's) of a file of ``key``; ValueError when it is not one this user can trust: a regular file
    this user owns (the store may sit in a folder others can write), of at most MAX_FILE_BYTES,
    whole, of ``key`` (and of ``num_labels`` classes, unless None: as many as its header says), every
    logit finite.
    """
    keys, logits, seconds, which, sets = read_columns(path, key, num_labels)
    return [bytes(row) for row in keys.view(f"V{KEY_BYTES}").ravel()], logits, seconds, [sets[i] for i in which]


def read_columns(path: str, key: str, num_labels: Optional[int]) -> tuple:
    """:func:`read_rows`' file as columns: (keys [n, 16] uint8, logits [n, K], seconds [n], each row's
    server set as an index into the sets, the sets: tuples of peer ids). Copies of the file's bytes,
    which are let go of as this returns (issue 51: no object per row).
    """
    data = memoryview(read_regular(path, MAX_FILE_BYTES, owner=os.geteuid()))
    if not data[:len(MAGIC)] == MAGIC:
        raise ValueError("not a row store file")
    start = len(MAGIC) + 8
    size = int.from_bytes(data[len(MAGIC):start], "little")
    try:
        header = json.loads(bytes(data[start:start + size]))
    except ValueError:
        raise ValueError("unreadable header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION or header.get("key") != key:
        raise ValueError("another key or format")
    rows, labels = header.get("rows"), header.get("num_labels")
    payload = data[start + size:]
    if num_labels is not None and labels != num_labels or not isinstance(labels, int) or labels < 1 \
            or not isinstance(rows, int) or len(payload) != rows * (KEY_BYTES + 4 * labels + 4):
        raise ValueError("another shape, or cut short")
    servers = header.get("servers")
    if _checksum(payload, servers) != header.get("sha256"):
        raise ValueError("checksum mismatch")
    which, sets = _row_servers(servers, rows)
    keys_end = rows * KEY_BYTES
    logits_end = keys_end + rows * 4 * labels
    keys = np.frombuffer(payload[:keys_end], dtype=np.uint8).reshape(rows, KEY_BYTES).copy()
    logits = np.frombuffer(payload[keys_end:logits_end], dtype="<f4").reshape(rows, labels).copy()
    seconds = np.frombuffer(payload[logits_end:], dtype="<f4").copy()
    if not np.isfinite(logits).all():
        raise ValueError("non-finite logits")
    return keys, logits, seconds, which, sets


def _row_servers(servers, rows: int) -> tuple:
    """(each row's server set: an index into the sets, the sets) from the header's ``servers``
    (ValueError where it does not fit).
    """
    if servers is None:
        return np.zeros(rows, dtype=np.int32), [()]
    try:
        sets = [tuple(str(p) for p in s) for s in servers["sets"]]
        numbers = range(len(sets))
        which = np.fromiter((numbers[i] for i in servers["rows"]), dtype=np.int32)  # IndexError: none such
    except (KeyError, TypeError, IndexError):
        raise ValueError("unreadable servers") from None
    if len(which) != rows:
        raise ValueError("unreadable servers")
    return which, sets
