"""One key's folder of the store (:class:`RowStore`): its rows read once per process, new ones written by a
rank's :class:`RowWriter` a file per flush; where the store is (:func:`store_root`).
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Dict, List, Optional, Tuple

import numpy as np

from dist_eval.atomic import atomic_write, cache_folder
from dist_eval.errors import warn
from dist_eval.rowstore.files import (
    BLAMED_SUFFIX,
    FORMAT_VERSION,
    SUFFIX,
    blamed_servers,
    read_columns,
    row_files,
    write_file,
)
from dist_eval.rowstore.rows import StoredRows


def store_root(option: str) -> Optional[str]:
    """The store's folder for ``--row-store`` (``auto``: the environment's, else the cache's); None: off."""
    if option == "auto":
        option = os.environ.get("DIST_EVAL_ROW_STORE") or ""
        if not option:  # the cache folder of the demo and of converted folders
            return os.path.join(cache_folder(), "rows")
    if option.strip().lower() in ("off", "none", "0", ""):
        return None
    return os.path.abspath(os.path.expanduser(option))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# (folder, key, classes) -> [the files read, the rows they hold (StoredRows)]: files are written once
_READ: Dict[tuple, list] = {}


class RowStore:
    """One key's folder: its rows read (:meth:`read`) and new ones written (:meth:`writer`)."""

    def __init__(self, root: str, model_facts: dict, task_facts: dict):
        self.model_key = _sha256(json.dumps(model_facts, sort_keys=True, default=str).encode())[:24]
        self.task_key = _sha256(json.dumps(task_facts, sort_keys=True, default=str).encode())[:24]
        self.key = f"{self.model_key}/{self.task_key}"
        self.folder = os.path.join(root, self.model_key, self.task_key)
        self.facts = {"model": model_facts, "task": task_facts}

    def read(self, num_labels: int) -> StoredRows:
        """The rows of every valid file (:class:`StoredRows`, a mapping {row key: (logits, seconds it
        took, the servers that computed it)}), but rows of a server a ``.blamed`` file names; the other
        files skipped, one warning. A file never changes once in place: one process reads each once (a
        run in rounds reads only the files written since its last round).
        """
        found = self._read(num_labels)
        blamed = blamed_servers(self.folder)
        return found.without_servers(blamed) if blamed else found

    def _read(self, num_labels: int) -> StoredRows:
        cached = _READ.setdefault((self.folder, self.key, num_labels), [set(), StoredRows.empty(num_labels)])
        read_before, parts = cached[0], []
        skipped: List[str] = []
        for path in row_files(self.folder):
            if path in read_before:
                continue
            read_before.add(path)
            try:
                parts.append(read_columns(path, self.key, num_labels))
            except (OSError, ValueError) as e:
                skipped.append(f"{os.path.basename(path)} ({e})")
                continue
        if skipped:
            warn(f"row store: skipped {len(skipped)} file(s) in {self.folder} that are not whole rows of this "
                 f"key that this user can trust (first: {skipped[0]}); those rows are evaluated again")
        if parts:  # oldest first: the newest copy of a row wins
            cached[1] = cached[1].joined(parts)
        return cached[1]

    def describe(self) -> None:
        """Write ``key.json`` (what the keys are made of) once, for a reader of the folder."""
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, "key.json")
        if not os.path.exists(path):
            atomic_write(path, json.dumps(self.facts, indent=1, sort_keys=True, default=str) + "\n")

    def writer(self, rank: int) -> RowWriter:
        return RowWriter(self.folder, self.key, rank)


class RowWriter:
    """A rank's new rows, written as a new file at each :meth:`flush`."""

    def __init__(self, folder: str, key: str, rank: int):
        self.folder, self.key = folder, key
        self.prefix = f"{uuid.uuid4().hex[:12]}-{os.getpid()}-r{rank}"
        self.sequence = 0
        self.pending: List[Tuple[np.ndarray, np.ndarray, np.ndarray, tuple]] = []
        self.blamed_written: set = set()

    def add(self, keys: np.ndarray, logits: np.ndarray, seconds: np.ndarray, servers: tuple = ()) -> None:
        """Rows (``servers``: the swarm servers whose answers the logits of every one of them come from)."""
        if len(keys):
            self.pending.append((keys, logits, seconds, tuple(sorted(servers))))

    def flush(self, blamed: Optional[Dict[str, dict]] = None) -> Optional[str]:
        """Write the rows added since the last flush, but those of a server in ``blamed`` (the run's blamed
        servers, {peer: evidence}: named in a ``.blamed`` file, once each).
        """
        blamed = blamed or {}
        new = {peer: evidence for peer, evidence in blamed.items() if peer not in self.blamed_written}
        if new:
            self._write_blamed(new)
        pending = [part for part in self.pending if not blamed.keys() & set(part[3])]
        self.pending.clear()
        if not pending:
            return None
        keys = np.concatenate([k for k, _, _, _ in pending])
        logits = np.concatenate([v for _, v, _, _ in pending]).astype("<f4")
        seconds = np.concatenate([s for _, _, s, _ in pending]).astype("<f4")
        servers = [part[3] for part in pending for _ in range(len(part[0]))]
        path = os.path.join(self.folder, f"{self.prefix}-{self.sequence:06d}{SUFFIX}")
        self.sequence += 1
        try:
            os.makedirs(self.folder, exist_ok=True)
            write_file(path, self.key, keys, logits, seconds, servers)
        except OSError as e:  # a full or read-only disk costs the reuse, not the run
            warn(f"row store: could not write {path} ({e}); these rows will be evaluated again next time")
            return None
        return path

    def _write_blamed(self, blamed: Dict[str, dict]) -> None:
        path = os.path.join(self.folder, f"{self.prefix}-{self.sequence:06d}{BLAMED_SUFFIX}")
        self.sequence += 1
        try:
            os.makedirs(self.folder, exist_ok=True)
            atomic_write(path, json.dumps({"format": FORMAT_VERSION, "key": self.key, "blamed": blamed},
                                          sort_keys=True, default=str) + "\n")
        except OSError as e:
            warn(f"row store: could not write {path} ({e}); rows of servers blamed in this run may be served later")
            return
        self.blamed_written.update(blamed)
