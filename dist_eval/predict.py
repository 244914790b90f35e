"""The no-grad loop over this rank's batches."""
from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dist_eval.backends.petals import audit
from dist_eval.backends.petals.audit import NonFiniteAnswer
from dist_eval.data.batches import Batch
from dist_eval.metrics import per_sample_cross_entropy
from dist_eval.results import FROM_STORE, SAMPLE_VALUE_PREFIX, ShardResults, mapped_array


class NonFiniteLogits(RuntimeError):
    """A forward returned NaN or inf logits: they never become predictions, losses or stored rows."""

    def __init__(self, batch_id: int, rows: np.ndarray, logits: np.ndarray):
        bad = rows[~np.isfinite(logits).all(axis=1)]
        shown = ", ".join(str(int(r)) for r in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        super().__init__(
            f"the model returned NaN or inf logits for {len(bad)} row(s) of batch {batch_id} (rows {shown}); "
            "none of them is counted or stored. A model or swarm server in float16 can overflow: serve the blocks "
            "in bfloat16 or float32 (python -m dist_eval.swarm --torch-dtype), or find the server at fault "
            "(python -m dist_eval.swarm status).")
        self.rows = bad


def _logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


# Batches in flight per rank. Measured (benchmarks/RESULTS.md): with a Petals swarm two
# batches in flight overlap one batch's RPC wait with the next one's client work.
DEFAULT_IN_FLIGHT = 2


def _timed_forward(model: Callable, input_ids: torch.Tensor, batch: Optional[Batch] = None) -> tuple:
    """(logits, seconds, None, the audited servers whose answers they come from or None: audit.Taken)."""
    # no_grad is thread-local: it must be entered in the thread that runs the forward
    with torch.no_grad():
        start = time.perf_counter()
        audit.begin_forward()
        try:
            logits = _logits_of(model(input_ids)).float().cpu()
        except NonFiniteAnswer as error:  # a swarm's, on every route: named by the batch's rows
            raise (error if batch is None else error.in_batch(batch[0], batch[1])) from None
        finally:
            taken = audit.end_forward()
        return logits, time.perf_counter() - start, None, taken


class _Ready:
    """A finished 'future' for a batch whose logits are known without a forward (``source``: where
    they came from, :mod:`dist_eval.known`).
    """

    def __init__(self, logits: np.ndarray, source: str, servers=()):
        taken = audit.Taken(None, frozenset(servers)) if servers else None  # an earlier run's swarm servers
        self.value = (torch.from_numpy(np.ascontiguousarray(logits)), None, source, taken)

    def result(self):
        return self.value


def _start(model: Callable, batch: Batch, known, submit):
    """A future of (logits, seconds or None, where known logits came from or None, audit.Taken or None) for one batch;
    ``submit(fn, *args)`` runs a forward. A batch whose logits ``known`` holds runs none.
    """
    hit = known.of(batch[0], batch[1]) if known is not None else None
    if hit is not None:
        return _Ready(*hit)
    return submit(_timed_forward, model, batch[2], batch)


class _Now:
    """A 'future' run at once (one batch in flight)."""

    def __init__(self, fn, *args):
        self.value = fn(*args)

    def result(self):
        return self.value


def _forwards_in_order(
    model: Callable, batches: Iterable[Batch], in_flight: int, known=None,
) -> Iterator[Tuple[Batch, torch.Tensor, Optional[float], Optional[str], Optional[audit.Taken]]]:
    """(batch, logits, seconds, source, taken) for every batch, in the order the batches came; seconds
    is None and source says where the logits came from for a batch whose logits ``known`` (a
    :class:`dist_eval.known.KnownLogits`) holds (no forward ran); taken: the audited swarm servers
    whose answers the logits come from (:class:`dist_eval.backends.petals.audit.Redo`), else None.

    With ``in_flight`` > 1 up to that many forwards run at once in worker threads (the
    petals client spends most of a forward waiting on the network); results are still
    yielded in batch order, so what follows is identical to a sequential run.
    """
    if in_flight <= 1:
        for batch in batches:
            yield (batch, *_start(model, batch, known, _Now).result())
        return
    pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="dist_eval-forward")
    pending: Deque = deque()
    try:
        for batch in batches:
            pending.append((batch, _start(model, batch, known, pool.submit)))
            if len(pending) >= in_flight:
                batch_done, future = pending.popleft()
                yield (batch_done, *future.result())
        while pending:
            batch_done, future = pending.popleft()
            yield (batch_done, *future.result())
    finally:
        # on an error, do not start queued forwards; running ones end within the client's timeouts
        pool.shutdown(wait=True, cancel_futures=True)


def _checked(logits: torch.Tensor, batch_id: int, rows: np.ndarray, num_labels: int) -> np.ndarray:
    if logits.shape != (len(rows), num_labels):
        raise RuntimeError(f"the model returned logits of shape {list(logits.shape)} for a batch of "
                           f"{len(rows)}; expected [{len(rows)}, {num_labels}]")
    batch_logits = logits.numpy()
    if not np.isfinite(batch_logits).all():
        raise NonFiniteLogits(batch_id, rows, batch_logits)
    return batch_logits


def _sample_value(name: str, fn: Callable, batch_logits: np.ndarray, batch_labels) -> np.ndarray:
    value = np.asarray(fn(batch_logits, np.asarray(batch_labels)), dtype=np.float64)
    if value.shape != (len(batch_logits),):
        raise ValueError(f"sample metric {name!r} returned shape {value.shape}, expected ({len(batch_logits)},)")
    return value


class _ColumnFiles:
    """One rank's per-row results, a column a file: each batch's rows written as it finishes to
    unlinked temporary files of $TMPDIR (freed however the process ends), so that the loop holds its
    batches in flight, not its rows (issue 51). A batch evaluated again is written in place (or,
    its rows fewer, at the end: ``spans`` say where each batch's rows are); ``kept``: the rows
    still counted of a batch some of whose rows were taken out (:meth:`ShardLoop.stored_due`).
    """

    def __init__(self, columns: Dict[str, tuple]):
        self.columns = columns  # {name: (dtype, shape of a row's value)}
        # open as long as the loop (its results' memory maps keep their own handles)
        self.files = {name: tempfile.TemporaryFile(prefix="dist_eval-rows-") for name in columns}  # noqa: SIM115
        self.spans: List[Tuple[int, int]] = []  # each batch's (first row in the files, rows)
        self.kept: Dict[int, np.ndarray] = {}
        self.end = 0  # rows written

    def __len__(self) -> int:
        return len(self.spans)

    def _row_bytes(self, name: str) -> int:
        dtype, shape = self.columns[name]
        return int(np.dtype(dtype).itemsize * np.prod(shape, dtype=np.int64))

    def put(self, position: int, values: Dict[str, np.ndarray]) -> None:
        """A batch's values by column, new (``position`` == len(self)) or in place of that batch's."""
        count = len(values["indices"])
        if position < len(self.spans) and position not in self.kept and self.spans[position][1] == count:
            start = self.spans[position][0]
        else:
            start, self.end = self.end, self.end + count
        for name, (dtype, shape) in self.columns.items():
            data = np.ascontiguousarray(values[name], dtype=dtype).reshape(count, *shape).tobytes()
            written = os.pwrite(self.files[name].fileno(), data, start * self._row_bytes(name))
            if written != len(data):  # a full disk writes short: never results with rows missing
                raise OSError(f"wrote {written} of {len(data)} bytes of the loop's results to $TMPDIR "
                              f"({tempfile.gettempdir()}): is it full? Point TMPDIR at a disk with room.")
        self.kept.pop(position, None)
        if position == len(self.spans):
            self.spans.append((start, count))
        else:
            self.spans[position] = (start, count)

    def batch(self, name: str, position: int) -> np.ndarray:
        """One batch's values of a column (its rows still counted)."""
        dtype, shape = self.columns[name]
        start, count = self.spans[position]
        size = self._row_bytes(name)
        data = os.pread(self.files[name].fileno(), count * size, start * size)
        values = np.frombuffer(data, dtype=dtype).reshape(count, *shape).copy()
        return values[self.kept[position]] if position in self.kept else values

    def keep_only(self, position: int, kept: np.ndarray) -> None:
        """Of a batch's rows still counted, only ``kept`` stay counted."""
        mask = self.kept.get(position, np.ones(self.spans[position][1], dtype=bool))
        mask[np.flatnonzero(mask)] = kept
        self.kept[position] = mask

    def rows_of(self, positions: Sequence[int], name: str) -> np.ndarray:
        """The values of a column, the batches ``positions`` one after another."""
        dtype, shape = self.columns[name]
        parts = [self.batch(name, position) for position in positions]
        return np.concatenate(parts) if parts else np.zeros((0, *shape), dtype=dtype)

    def whole(self) -> Dict[str, np.ndarray]:
        """Every column, the batches in order: memory maps of the files, read-only (copied into new ones,
        a batch at a time, where batches were written out of order or lost rows).
        """
        in_order = not self.kept and all(span[0] == start for span, start in
                                         zip(self.spans, np.cumsum([0] + [c for _, c in self.spans]).tolist()))
        total = sum(count for _, count in self.spans) - sum(int((~m).sum()) for m in self.kept.values())
        out = {}
        for name, (dtype, shape) in self.columns.items():
            if not total:
                out[name] = np.zeros((0, *shape), dtype=dtype)
            elif in_order:
                out[name] = np.asarray(np.memmap(self.files[name], dtype=dtype, mode="r", shape=(total, *shape)))
            else:
                out[name], at = mapped_array((total, *shape), dtype), 0
                for position in range(len(self.spans)):
                    values = self.batch(name, position)
                    out[name][at:at + len(values)], at = values, at + len(values)
        return out


class ShardLoop:
    """One rank's forward loop and its results (run by :func:`forward_passes`, under ``torch.no_grad()``);
    :func:`redo_blamed_on_other_ranks` evaluates again, in place, its batches of swarm servers blamed on
    other ranks. ``known`` (a :class:`dist_eval.known.KnownLogits`): a batch whose logits it holds (an
    interrupted run's, the row store's) is not run; every batch done is given back to it.
    """

    def __init__(self, model: Callable, num_labels: int, keep_logits: bool,
                 sample_metrics: Optional[Dict[str, Callable]] = None, known=None):
        self.model, self.num_labels, self.keep_logits, self.known = model, num_labels, keep_logits, known
        self.sample_metrics = sample_metrics or {}
        self.rows = _ColumnFiles({
            "indices": (np.int64, ()), "labels": (np.int64, ()), "preds": (np.int64, ()), "losses": (np.float64, ()),
            **({"logits": (np.float32, (num_labels,))} if keep_logits else {}),
            **{SAMPLE_VALUE_PREFIX + name: (np.float64, ()) for name in self.sample_metrics}})
        self.sources: list = []  # where each batch's logits came from (None: a forward of this run)
        self.redone_positions: set = set()  # batches evaluated again since :meth:`take_redone`
        self.from_store: set = set()  # positions of the row store's batches (rank 0), their servers recorded
        self.store_blamed: set = set()  # the blamed servers their rows were looked at for
        self.forward_seconds, self.max_batch_seconds = 0.0, 0.0
        # batches of a swarm server blamed later are evaluated again, in place (its client's ledger: routes avoid it)
        self.redo = audit.Redo(audit.ledger_of(getattr(model, "sequence_manager", None)))
        before = getattr(known, "blamed_before", None)
        if before:  # blamed in the runs a resume folder holds (every rank reads every rank's files): left out
            self.redo.learn({peer: ({**evidence, "blamed_in_an_earlier_run": True}, []) for peer, evidence in
                             sorted(before.items())})

    def put(self, position: int, batch: Batch, logits: torch.Tensor, source: Optional[str], taken) -> None:
        batch_id, rows, _, batch_labels = batch
        rows = np.asarray(rows, dtype=np.int64)
        batch_logits = _checked(logits, batch_id, rows, self.num_labels)
        if self.known is not None:
            if position < len(self.sources) and self.sources[position] is not None:
                self.known.redone(self.sources[position], rows)  # known logits replaced: no longer counted as such
            self.known.took(batch_id, rows, batch_logits, source, taken)  # evaluated again: its newer copy wins
        # argmax picks the first maximum on ties, the same on every rank
        self.rows.put(position, {
            "indices": rows, "labels": np.asarray(batch_labels, dtype=np.int64),
            "preds": batch_logits.argmax(axis=1).astype(np.int64),
            "losses": per_sample_cross_entropy(batch_logits, batch_labels),
            **({"logits": batch_logits} if self.keep_logits else {}),
            **{SAMPLE_VALUE_PREFIX + name: _sample_value(name, fn, batch_logits, batch_labels)
               for name, fn in self.sample_metrics.items()}})
        if position == len(self.sources):
            self.sources.append(source)
        else:
            self.sources[position] = source

    def run(self, batches: Iterable[Batch], on_batch_done: Optional[Callable[[int], None]] = None,
            in_flight: int = 1) -> None:
        """Every batch, in order; ``in_flight`` batches at once (results identical for any value);
        ``on_batch_done(num_rows)`` after each (progress).
        """
        for batch, logits, seconds, source, taken in _forwards_in_order(self.model, batches, in_flight, self.known):
            if seconds is not None:
                self.forward_seconds += seconds
                self.max_batch_seconds = max(self.max_batch_seconds, seconds)
            self.put(len(self.rows), batch, logits, source, taken)
            self.redo.watch(len(self.rows) - 1, batch, taken)
            if source == FROM_STORE:  # looked at for every server blamed so far too
                self.from_store.add(len(self.rows) - 1)
                self.store_blamed = set()
            self.evaluate_again()
            if on_batch_done is not None:
                on_batch_done(len(batch[1]))

    def evaluate_again(self) -> None:
        """The batches of swarm servers blamed since, evaluated again on the others, their results put in
        place, until no redo meets a server blamed meanwhile.
        """
        due = self.redo.due() + self.stored_due()
        while due:
            for position, again in due:  # None: the row store's rows taken out of their batch, a new batch
                position = len(self.rows) if position is None else position
                logits, _, _, taken = _timed_forward(self.model, again[2], again)
                self.redo.redone(position, again, taken, len(again[1]))
                self.put(position, again, logits, None, taken)
                self.redone_positions.add(position)
            due = self.redo.due() + self.stored_due()

    def stored_due(self) -> list:
        """(None, batch) of the row store's rows served in this run that a server blamed since computed (the
        store records each row's servers): taken out of their batch (no longer counted as served), tokenized
        now and planned as the run's rows (:attr:`dist_eval.known.KnownLogits.batches_of`), a batch each.
        """
        blamed = self.redo.blamed() if self.from_store else set()
        if blamed <= self.store_blamed:
            return []
        self.store_blamed = blamed
        due = []
        for position in sorted(self.from_store):
            rows = self.rows.batch("indices", position)
            bad = np.array([bool(servers & blamed) for servers in self.known.stored_servers(rows)], dtype=bool)
            if bad.any():
                labels = self.rows.batch("labels", position)[bad]
                self.known.redone(FROM_STORE, rows[bad])
                self.rows.keep_only(position, ~bad)
                due += [(None, batch) for batch in self.known.batches_of(rows[bad], labels)]
        return due

    def take_redone(self) -> Optional[dict]:
        """The results of the batches evaluated again since the last call (rows, preds, losses, logits,
        sample values, concatenated), or None.
        """
        positions, self.redone_positions = sorted(self.redone_positions), set()
        if not positions:
            return None
        return {("rows" if name == "indices" else name): self.rows.rows_of(positions, name)
                for name in self.rows.columns if name != "labels"}

    def results(self) -> ShardResults:
        """This rank's results, the batches in order: memory maps of its files (:class:`_ColumnFiles`)."""
        columns = self.rows.whole()
        return ShardResults(
            indices=columns.pop("indices"), labels=columns.pop("labels"), preds=columns.pop("preds"),
            losses=columns.pop("losses"), logits=columns.pop("logits", None),
            sample_values={name[len(SAMPLE_VALUE_PREFIX):]: values for name, values in columns.items()},
            forward_seconds=self.forward_seconds,
            max_batch_seconds=self.max_batch_seconds,
            num_resumed=self.known.rows_resumed if self.known is not None else 0,
        )


# Exchanges of blamed servers after the forward loop, at most: each one that goes on blamed at least one
# server more (a swarm of more servers blamed than this is stopped, in one line, on every rank alike)
MAX_BLAME_EXCHANGES = 16


def forward_passes(forward: Callable, num_labels: int, batches, known, in_flight: int, sample_metrics=None,
                   on_batch_done=None, loops: Optional[list] = None) -> ShardResults:
    """Every rank: its forwards of ``batches`` (a phase): finished batches are given to ``known`` (a
    :class:`dist_eval.known.KnownLogits`) as they come, and kept when the phase fails; one rank's failure
    stops the others at their next batch. Then the batches of swarm servers any rank's audit blamed,
    evaluated again (:func:`redo_blamed_on_other_ranks`; ``loops``: the earlier rounds' loops, this
    one's appended where a swarm audit may blame a server later).
    """
    from dist_eval import ranks

    loop = ShardLoop(forward, num_labels, keep_logits=True, sample_metrics=sample_metrics, known=known)
    with ranks.phase("the forward passes", stop_early=True) as failed:

        def after_batch(num_rows: int) -> None:
            if on_batch_done is not None:
                on_batch_done(num_rows)
            failed.check()

        try:
            loop.run(batches, on_batch_done=after_batch, in_flight=in_flight)
        finally:
            known.flush()  # also on failure: finished batches are not lost
    redo_blamed_on_other_ranks(loop, loops or ())
    if loops is not None:  # kept only where a swarm audit may blame a server later
        loops.append(loop if loop.redo.ledgers else None)
    return loop.results()


def redo_blamed_on_other_ranks(loop: ShardLoop, earlier: Sequence[Optional[ShardLoop]] = ()) -> None:
    """Every rank, after its forward loop (every rank's finished): the servers each rank blamed, shared
    (:func:`~dist_eval.ranks.collectives.union_by_key`, the evidence with them); each rank leaves out the
    union and evaluates again its batches any of them answered (a phase: one rank's failure, e.g. no
    route left, fails every rank in one line), until an exchange names no server more: every rank
    takes the same steps (the union is the same on each). ``earlier``: the loops of a run's earlier
    rounds (stopping early), whose batches are evaluated again too (:func:`redone_in_earlier_rounds`).
    What is evaluated again is stored (the loops' known logits). A no-op in one process without a
    blame, and without a swarm audit (no collective then).
    """
    from dist_eval import ranks
    from dist_eval.ranks.collectives import union_by_key

    loops = [one for one in (*earlier, loop) if one is not None]
    if not any(one.redo.ledgers for one in loops):
        return  # no swarm audit, so nothing to blame: the same on every rank (one model, one --audit share)
    known: set = set()
    for _ in range(MAX_BLAME_EXCHANGES):
        blamed: Dict[str, dict] = {}
        for one in loops:
            blamed.update(one.redo.own_blames())
        union = union_by_key(blamed)
        if set(union) == known:
            return
        known = set(union)
        with ranks.phase("evaluating again the batches of servers blamed on any rank"):
            for one in loops:
                try:
                    one.redo.learn(union)
                    one.evaluate_again()
                finally:
                    if one.known is not None:
                        one.known.flush()
    with ranks.phase("evaluating again the batches of servers blamed on any rank"):
        raise audit.AuditMismatch(
            f"swarm audit: servers were still being blamed after {MAX_BLAME_EXCHANGES} exchanges between the ranks "
            f"({len(known)} blamed: {', '.join(sorted(known))}); stop the blamed servers, then run again.")


def redone_in_earlier_rounds(loops: Sequence[Optional[ShardLoop]]) -> Dict[int, list]:
    """Every rank (a collective), after a round of a run that stops early: {round index: [each rank's
    :meth:`ShardLoop.take_redone`]} of the earlier rounds (``loops``: this rank's, one per round, the
    last the round just run) whose batches were evaluated again, on rank 0 ({} elsewhere): rank 0
    puts them in place of the results it merged then (:meth:`dist_eval.stopping.Seen.patch`).
    """
    from dist_eval import ranks

    if all(one is None for one in loops):
        return {}  # no swarm audit (every rank alike): no round is evaluated again, no collective
    if loops[-1] is not None:
        loops[-1].take_redone()  # the round just run: merged as redone
    mine = {index: one.take_redone() for index, one in enumerate(loops[:-1]) if one is not None}
    gathered = ranks.all_gather_object({index: part for index, part in mine.items() if part is not None})
    if not ranks.is_main_process():
        return {}
    out: Dict[int, list] = {}
    for theirs in gathered:
        for index, part in theirs.items():
            out.setdefault(index, []).append(part)
    return dict(sorted(out.items()))
