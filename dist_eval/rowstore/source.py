"""A run's use of the store: its key (:func:`store_for`, :func:`run_store`), the rows it holds of a set
(:func:`open_rows`), and :class:`RowSource`, which serves them to the forward loop and writes the new ones.
"""
from __future__ import annotations

import json
import time
from typing import Dict, List, Optional

import numpy as np

from dist_eval.backends.provenance import tokenizer_digest
from dist_eval.chunks import chunk_rows
from dist_eval.errors import warn
from dist_eval.results import mapped_array
from dist_eval.rowstore.files import FORMAT_VERSION
from dist_eval.rowstore.keys import KEY_BYTES, library_versions, row_keys, settings_facts
from dist_eval.rowstore.rows import RowValues, StoredRows
from dist_eval.rowstore.store import RowStore, RowWriter, store_root


class RowSource:
    """A rank's view of the store in one evaluation: the rows the store holds (``stored_rows``,
    the same on every rank: the batch plan leaves them out), their logits (``logits``: {row:
    logits}, rank 0's, which reports them), every row's key, and the writer of the rows this rank
    evaluates (:meth:`add`); the rows served (:meth:`served`) and the seconds they had cost.
    """

    def __init__(self, message: Optional[tuple], rank: int, save_interval: float = 0.0):
        self.logits: Dict[int, np.ndarray] = {}  # rank 0: RowValues (open_rows), a mapping by row as this
        self.seconds: Dict[int, float] = {}
        self.stored_rows = np.zeros(0, dtype=np.int64)
        self.key_array: Optional[np.ndarray] = None
        self.writer: Optional[RowWriter] = None
        self.folder: Optional[str] = None
        self.fresh = False
        self.rows_served, self.seconds_saved = 0, 0.0
        self.read_seconds, self.write_seconds = 0.0, 0.0  # the store's own cost in this run
        self.interval, self.last_flush = save_interval, time.monotonic()
        self.ledgers: Dict[int, object] = {}  # the swarm audits of the rows added: their blamed servers
        self.which: Dict[int, int] = {}  # rank 0: {row: its servers' index in server_sets} (RowValues)
        self.server_sets: list = [()]
        self.last_batch = time.perf_counter()  # the wall time of each batch: since the one before
        if message is None:
            return
        self.folder, key, keys, self.stored_rows, self.fresh = message
        self.key_array = mapped_array(keys.shape, keys.dtype)  # every row's key (16 bytes): on disk, not the heap
        self.key_array[:] = keys
        self.writer = RowWriter(self.folder, key, rank)

    def served(self, rows: np.ndarray) -> None:
        """A batch of rows whose logits came from the store (no forward ran; the next batch's time starts now)."""
        self.rows_served += len(rows)
        self.seconds_saved += sum(self.seconds[int(r)] for r in rows)
        self.last_batch = time.perf_counter()

    def unserved(self, rows: np.ndarray) -> None:
        """Rows served earlier in this run evaluated again (a server that computed them blamed since)."""
        self.rows_served -= len(rows)
        self.seconds_saved -= sum(self.seconds[int(r)] for r in rows)

    def servers_of(self, rows: np.ndarray) -> List[frozenset]:
        """Rank 0: the swarm servers that computed each of these served rows (as the store recorded them)."""
        return [frozenset(self.server_sets[int(self.which[int(r)])]) for r in rows]

    def add(self, rows: np.ndarray, logits: np.ndarray, taken=None) -> None:
        """Rows just evaluated, written at most every save interval, each with its share of the
        rank's wall time since the batch before (batches in flight overlap: not their forward's);
        ``taken`` (:class:`~dist_eval.backends.petals.audit.Taken`): the swarm servers they come from.
        """
        now = time.perf_counter()
        elapsed, self.last_batch = now - self.last_batch, now
        if self.writer is None or not len(rows):
            return
        if taken is not None and taken.ledger is not None:  # None: the audit off (the servers still recorded)
            self.ledgers.setdefault(id(taken.ledger), taken.ledger)
        self.writer.add(self.key_array[rows], logits, np.full(len(rows), elapsed / len(rows), dtype=np.float32),
                        taken.servers if taken is not None else ())
        if time.monotonic() - self.last_flush >= self.interval:
            self.flush()

    def flush(self) -> None:
        """Write the rows pending, but those of a server the audit blamed (named in a ``.blamed`` file)."""
        start = time.perf_counter()
        if self.writer is not None:
            blamed: Dict[str, dict] = {}
            for ledger in self.ledgers.values():
                with ledger.lock:
                    blamed.update(ledger.excluded)
            self.writer.flush(blamed)
        self.last_flush = time.monotonic()
        self.write_seconds += time.perf_counter() - start


def open_rows(store: Optional[RowStore], fresh: bool, data, columns: List[str], num_labels: int,
              save_interval: float = 0.0) -> RowSource:
    """Every rank: its :class:`RowSource`. Rank 0 alone reads the store (``store``: rank 0's;
    None: off) and the rows' texts, and sends every rank the rows' keys and which rows the store
    holds: every rank plans the same batches of the others, for any N; rank 0 keeps their logits.
    """
    from dist_eval import ranks

    message, found = None, None
    if ranks.is_main_process() and store is not None:
        try:
            store.describe()
        except OSError as e:
            warn(f"row store: cannot write in {store.folder} ({e}); evaluating every row, storing none")
            store = None
    if ranks.is_main_process() and store is not None:
        keys = _keys_of(data, columns)
        held = StoredRows.empty(num_labels) if fresh else store.read(num_labels)
        rows, positions = held.find(keys)
        found = RowValues.of(held, rows, positions, len(keys))
        message = (store.folder, store.key, keys, rows, fresh)
    source = RowSource(ranks.broadcast_object(message), ranks.get_rank(), save_interval)
    if found is not None:
        source.logits, source.seconds = found
        source.which, source.server_sets = RowValues(held.which, found[0].slots, found[0].count), held.sets
    return source


def _keys_of(data, columns: List[str]) -> np.ndarray:
    """:func:`row_keys` of every row of ``data``, its texts read a chunk of rows at a time (issue 51: only
    the 16-byte keys are kept).
    """
    from dist_eval.data.sample import column_values

    parts, chunk = [], chunk_rows("store_keys")
    for start in range(0, len(data), chunk):
        values = column_values(data, columns, slice(start, start + chunk))
        parts.append(row_keys(values[0], values[1] if len(values) > 1 else None))
    return np.concatenate(parts) if parts else np.zeros((0, KEY_BYTES), dtype=np.uint8)


def store_for(option: str, model, tokenizer, settings, pad_token_id) -> Optional[RowStore]:
    """Rank 0: the store folder of this model, checkpoint, tokenizer and settings; None when the
    store is off, or the model has no identity (a model object or callable: its weights may
    change between calls, as in a training loop; only ``load_model``'s and the CLI's are kept).
    """
    root = store_root(option)
    identity = getattr(model, "identity", None)
    if root is None or identity is None or tokenizer is None:
        return None
    model_facts = {**identity["model"], "libraries": library_versions(), "servers": _server_numerics(model)}
    task_facts = {"format": FORMAT_VERSION, "trainable": identity["trainable"],
                  "tokenizer": tokenizer_digest(tokenizer), "settings": settings_facts(settings),
                  "num_labels": model.num_labels, "prompt_tokens": model.prompt_tokens, "pad_token_id": pad_token_id}
    return RowStore(root, model_facts, task_facts)


def run_store(option: str, model, tokenizer, settings, pad_token_id) -> Optional[RowStore]:
    """Rank 0: this run's store (:func:`store_for`); None on the other ranks, and where it cannot be keyed
    (a warning: that costs the reuse, never the run).
    """
    from dist_eval import ranks

    if not ranks.is_main_process():
        return None
    try:
        return store_for(option, model, tokenizer, settings, pad_token_id)
    except Exception as e:
        warn(f"row store: not used in this run ({type(e).__name__}: {e})")
        return None


def _server_numerics(model) -> Optional[list]:
    """A swarm's servers as far as their numbers go: each distinct (petals version, dtype,
    quantization, adapters) announced; None for an in-process backend.
    """
    if model.backend != "petals":
        return None
    servers = (model.provenance() or {}).get("servers", [])
    return sorted({json.dumps([s.get("petals_version"), s.get("torch_dtype"), s.get("quantization"),
                               s.get("adapters")]) for s in servers})
