"""Known logits: what a rank's forward loop need not compute, from one source with two providers,
and where the logits it does compute go.

- **The resume folder** (:mod:`dist_eval.resume`): the batches an interrupted run of this exact
  plan finished, keyed by batch id, so that a resumed run is the same batches, bit for bit.
- **The row store** (:mod:`dist_eval.rowstore`): rows any earlier run of this model, checkpoint
  and settings evaluated, keyed by each row's content. The batch plan leaves them out (the same on
  every rank) and rank 0 reports them as batches of their own (ids below 0: no plan's).

:func:`batches_with_known` opens both with this rank's batches, in one place, in the order the plan
needs them (the store before the batch plan, which leaves its rows out; the resume folder after,
which is keyed by the plan's batches). The loop (:class:`dist_eval.predict.ShardLoop`) asks :meth:`KnownLogits.of`
before each forward and gives back every batch it finished (:meth:`KnownLogits.took`): this object
is the one place a row's logits enter or leave the run other than a forward.
"""
from __future__ import annotations

import time
from functools import partial
from itertools import chain
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from dist_eval import ranks
from dist_eval.data.batches import Batch, known_batches, plan_batches
from dist_eval.data.labels import TaskColumns, classes_of
from dist_eval.data.loader import loader_batches
from dist_eval.data.shard import dataset_batches
from dist_eval.data.tokenize import right_pad, tokenize_rows
from dist_eval.loop_facts import StoreFacts
from dist_eval.results import FROM_RESUME, FROM_STORE
from dist_eval.resume import PartialWriter, open_partial
from dist_eval.rowstore import RowSource, open_rows, run_store


class KnownLogits:
    """One rank's known logits (see the module's docstring)."""

    def __init__(self, num_rows: int):
        self.rows = RowSource(None, ranks.get_rank())  # the row store's, once opened (_dataset_batches); else none
        self.resumed: Dict[int, np.ndarray] = {}  # {batch id: logits} an interrupted run stored
        self.resumed_servers: Dict[int, tuple] = {}  # {batch id: the swarm servers its logits come from}
        self.blamed_before: Dict[str, dict] = {}  # servers the swarm audit blamed in the runs the folder holds
        self.partial: Optional[PartialWriter] = None
        self.rows_resumed = 0
        self.num_rows = num_rows  # the rows of the data
        self.shard_rows: Optional[np.ndarray] = None  # a shard's rows (sorted); None: every row
        # rows -> their batches, tokenized then (the row store's rows served, evaluated again: _dataset_batches)
        self.batches_of: Optional[Callable[[np.ndarray, np.ndarray], List[Batch]]] = None

    # ---------------------------------------------------------------- the plan
    @property
    def stored_rows(self) -> np.ndarray:
        """The rows the store holds, the same on every rank: the batch plan leaves them out."""
        return self.rows.stored_rows

    def keep_rows(self, rows: np.ndarray) -> None:
        """A shard's rows (sorted): the store serves and reports only those."""
        self.shard_rows = rows
        self.rows.stored_rows = self.rows.stored_rows[np.isin(self.rows.stored_rows, rows)]

    # ---------------------------------------------------------------- the loop
    def of(self, batch_id: int, rows: np.ndarray) -> Optional[Tuple[np.ndarray, str, tuple]]:
        """(logits, FROM_RESUME or FROM_STORE, the swarm servers they come from where the resume folder
        says: a server blamed later has them evaluated again) when no forward is needed for this batch, else None.
        """
        if batch_id in self.resumed:
            return self.resumed[batch_id], FROM_RESUME, self.resumed_servers.get(batch_id, ())
        known = self.rows.logits
        if known and all(int(r) in known for r in rows):
            return np.stack([known[int(r)] for r in rows]), FROM_STORE, ()
        return None

    def took(self, batch_id: int, rows: np.ndarray, logits: np.ndarray, source: Optional[str], taken=None) -> None:
        """A batch done: ``source`` None when a forward computed ``logits`` (kept in the resume folder
        and the row store; ``taken``: the audited swarm servers they come from), else where they
        came from (counted).
        """
        if source == FROM_RESUME:
            self.rows_resumed += len(rows)
        elif source == FROM_STORE:
            self.rows.served(rows)
        else:
            self.rows.add(rows, logits, taken)
            if self.partial is not None and batch_id >= 0:  # not a plan's batch (the store's rows again): not kept
                self.partial.add(batch_id, rows, logits, *((taken.servers, taken.ledger) if taken is not None else ()))

    def redone(self, source: str, rows: np.ndarray) -> None:
        """A batch whose logits came from ``source`` evaluated again (a swarm server of it blamed since)."""
        if source == FROM_RESUME:
            self.rows_resumed -= len(rows)
        elif source == FROM_STORE:
            self.rows.unserved(rows)

    def stored_servers(self, rows: np.ndarray) -> List[frozenset]:
        """Rank 0: the swarm servers that computed each of the row store's rows served (empty: none recorded)."""
        return self.rows.servers_of(rows)

    def flush(self) -> None:
        """Write what is pending (also after a failure: the finished batches are not lost)."""
        if self.partial is not None:
            self.partial.flush()
        self.rows.flush()

    # ---------------------------------------------------------------- the report
    def store_facts(self) -> StoreFacts:
        """The row store in this evaluation, over all ranks (every rank calls it, after the loop): the
        rows it served and those evaluated (neither served nor resumed); rank 0's reading (with the keys
        and the exchange), all ranks' writing.
        """
        rows, num_rows = self.rows, self.num_rows if self.shard_rows is None else len(self.shard_rows)
        served, saved, written, resumed = ranks.all_reduce_sum(np.array([rows.rows_served, rows.seconds_saved,
                                                                         rows.write_seconds, self.rows_resumed]))
        folder, read = ranks.broadcast_object((rows.folder, rows.read_seconds))
        # each row's seconds are a rank's wall time for it; this run's ranks would have shared them
        return StoreFacts(folder=folder, fresh_rows=bool(rows.fresh), rows_from_store=int(served),
                          rows_evaluated=int(num_rows - served - resumed),
                          seconds_saved=float(saved) / ranks.get_world_size(), read_seconds=read,
                          write_seconds=float(written))


def batches_with_known(data, tokenizer, settings, options, task, resume_folder: Optional[str] = None,
                       on_plan=None, whole_set=None) -> Tuple[Iterator, int, KnownLogits]:
    """Every rank: (this rank's batches, rows truncated here, its :class:`KnownLogits`), both providers
    opened here, in one call. ``data``: a Dataset of the rows drawn, whole (:func:`_dataset_batches`), or
    a DataLoader (its batches are the user's; nothing is known). ``task``: the model and its forward
    facts (:class:`dist_eval.backends.objects.Task`).
    """
    loader = isinstance(data, torch.utils.data.DataLoader)
    known = KnownLogits(len(data.dataset) if loader else len(data))
    if not loader:
        batches, num_truncated = _dataset_batches(known, data, tokenizer, settings, options, task, resume_folder,
                                                  on_plan, whole_set)
        return batches, num_truncated, known
    with ranks.phase("tokenizing the data"):
        return loader_batches(data), 0, known


def _dataset_batches(known: KnownLogits, data, tokenizer, settings, options, task, resume_folder: Optional[str],
                     on_plan, whole_set) -> Tuple[Iterator, int]:
    """(this rank's batches of a Dataset, rows truncated here), ``known`` opened with them, each step in
    its phase: the labels read as class ids (``task.label_names`` completed with the data's class names;
    ``whole_set``: the Rows of the set a round is drawn from: :func:`dist_eval.data.labels.classes_of`);
    the row store read (rank 0 reads it, every rank learns which rows it holds; nothing is known for a
    model without an identity or with the store off, ``options.row_store``); the batch plan, which leaves
    its rows out (:func:`dist_eval.data.shard.dataset_batches`; ``options.shard_part``: (I, K), the rows
    of shard I of K only, ``known.shard_rows``); the resume folder, for this rank's batches of the plan.
    Rank 0's batches start with the store's rows, as batches whose logits are known.
    """
    from dist_eval.backends.families import tokenizers_calling_the_base

    with ranks.phase("preparing the data"):
        labels, task.label_names = classes_of(data, settings.label_column, task.num_labels, task.label_names,
                                              task.label_words, whole_set)
    with ranks.phase("reading the row store"):
        start = time.perf_counter()
        store = run_store(options.row_store, task.model, tokenizer, settings, task.pad_token_id)
        columns = [settings.text_column] + ([settings.text_pair_column] if settings.text_pair_column else [])
        known.rows = open_rows(store, options.fresh_rows, data, columns, task.num_labels, options.save_interval)
        known.rows.read_seconds = time.perf_counter() - start
        if known.rows.logits:  # the store's rows evaluated again are tokenized and planned as the run's
            known.batches_of = partial(_batches_of, tokenizer, settings, task.pad_token_id, task.prompt_tokens, data)
    with ranks.phase("tokenizing the data"):
        batches, num_truncated, own_batches = dataset_batches(
            data, tokenizer, labels, settings, pad_token_id=task.pad_token_id, prefix_tokens=task.prompt_tokens,
            on_plan=on_plan, skip_rows=known.stored_rows, calling_the_base=tokenizers_calling_the_base(),
            shard=options.shard_part, on_shard=known.keep_rows,
        )
    with ranks.phase("reading the stored partial results"):
        known.resumed, known.resumed_servers, known.blamed_before, known.partial = open_partial(
            resume_folder, own_batches, task.num_labels, options.save_interval)
    # rank 0 (it holds the store's logits) hands out the store's rows first
    served = known.rows.stored_rows if known.rows.logits else np.zeros(0, np.int64)
    return chain(known_batches(served, labels), batches), num_truncated


# Batch ids of the row store's rows evaluated again (below the store's own, -1 - i: no plan's)
_AGAIN_IDS = -(1 << 40)


def _batches_of(tokenizer, settings, pad_token_id: int, prefix_tokens: int, data, rows: np.ndarray,
                labels: np.ndarray) -> List[Batch]:
    """``rows`` of ``data`` (their ``labels``) tokenized and planned as the run's settings plan rows."""
    from dist_eval.backends.families import tokenizers_calling_the_base

    ids = tokenize_rows(tokenizer, data, rows, TaskColumns.of(settings), settings.max_length, pad_token_id,
                        calling_the_base=tokenizers_calling_the_base())[0]
    lengths = np.array([len(one) for one in ids], dtype=np.int64)
    by_length = settings.length_buckets or settings.max_batch_tokens is not None
    planned = plan_batches(len(rows), settings.batch_size, lengths if by_length else None, settings.max_batch_tokens,
                           length_buckets=settings.length_buckets, prefix_tokens=prefix_tokens)
    return [(_AGAIN_IDS - i, rows[b], right_pad([ids[j] for j in b], pad_token_id), labels[b])
            for i, b in enumerate(planned)]
