"""Partial results on disk, so that an interrupted run resumes without losing work.

Each rank appends the logits of the batches it finished to ``<dir>/<run key>/``, one
small ``.npz`` file per flush, written to a temporary name and renamed into place: a
reader sees a whole file or none. A batch is identified by its id in the global batch
plan, which depends only on the data and the settings, never on the world size; so a
run restarted with another number of ranks still finds every stored batch.

The run key is a hash of everything that decides a batch's logits: the model folder
(its config and the names, sizes and modification times of its weight files), the
checkpoint's bytes, the data's fingerprint and the settings. Stored results under
another key are never mixed in: the run says so and removes them.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

SUBDIR = "partial"


def _file_facts(folder: str) -> List[Tuple[str, int, int]]:
    facts = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            stat = os.stat(path)
            facts.append((name, stat.st_size, int(stat.st_mtime)))
    return facts


def _sha256_of_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def run_key(model_dir: str, checkpoint: Optional[str], data_fingerprint: str, settings: dict) -> str:
    """A short hash of what decides the results (weights are identified by name, size and
    mtime, not hashed: hashing a 100 GB model at every start would cost minutes)."""
    facts = {
        "model_files": _file_facts(model_dir),
        "checkpoint_sha256": _sha256_of_file(checkpoint) if checkpoint else None,
        "data": data_fingerprint,
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_fingerprint(dataset) -> str:
    """The ``datasets`` fingerprint (derived from the source files' content) and size."""
    return f"{getattr(dataset, '_fingerprint', None)}:{len(dataset)}:{dataset.column_names}"


def stale_runs(root: str, key: str) -> List[str]:
    """Folders of partial results made by another model, checkpoint, data or settings."""
    return [p for p in glob.glob(os.path.join(root, SUBDIR, "*")) if os.path.basename(p) != key and os.path.isdir(p)]


def remove(paths: Iterable[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def load(folder: str, wanted_batches: Iterable[int]) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    """{batch id: (row indices, logits)} of the stored batches among ``wanted_batches``."""
    wanted = set(int(b) for b in wanted_batches)
    found: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.npz"))):
        with np.load(path) as f:
            batch_ids, offsets, rows, logits = f["batch_ids"], f["offsets"], f["rows"], f["logits"]
        for i, b in enumerate(batch_ids.tolist()):
            if b in wanted:
                found[b] = (rows[offsets[i] : offsets[i + 1]], logits[offsets[i] : offsets[i + 1]])
    return found


class PartialWriter:
    """Collects finished batches of one rank and writes them atomically, at most every
    ``interval`` seconds (0: after every batch) and at :meth:`flush`."""

    def __init__(self, folder: str, rank: int, interval: float):
        self.folder, self.rank, self.interval = folder, rank, interval
        os.makedirs(folder, exist_ok=True)
        self._pending: List[Tuple[int, np.ndarray, np.ndarray]] = []
        self._last_flush = time.monotonic()
        self._sequence = len(glob.glob(os.path.join(folder, f"rank{rank}-*.npz")))

    def add(self, batch_id: int, rows: np.ndarray, logits: np.ndarray) -> None:
        self._pending.append((batch_id, rows, logits))
        if time.monotonic() - self._last_flush >= self.interval:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        lengths = [len(rows) for _, rows, _ in self._pending]
        payload = {
            "batch_ids": np.array([b for b, _, _ in self._pending], dtype=np.int64),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "rows": np.concatenate([rows for _, rows, _ in self._pending]).astype(np.int64),
            "logits": np.concatenate([logits for _, _, logits in self._pending]).astype(np.float32),
        }
        # a new name per flush (never overwritten), written under a temporary name first
        # (pid and time in it: a restarted rank never collides with a dead one's leftovers)
        final = os.path.join(self.folder, f"rank{self.rank}-{os.getpid()}-{self._sequence:06d}.npz")
        tmp = final + ".tmp"
        # no fsync: the rename alone is atomic for readers, which is what a killed rank
        # needs; a machine crash may lose the last flushes, which are then simply re-run
        with open(tmp, "wb") as f:
            np.savez(f, **payload)
        os.replace(tmp, final)
        self._sequence += 1
        self._pending.clear()
        self._last_flush = time.monotonic()
