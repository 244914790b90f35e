"""Merge every rank's results: totals reduced over ranks, per-sample arrays gathered to
rank 0, ordered by index, de-duplicated, checked to cover every row of the split exactly
once; then the report of the merged rows, all of it :mod:`dist_eval.scoring`'s (on rank 0,
broadcast to every rank; the score intervals' resamples shared over the ranks).

Values are ``local_`` (one rank's) or ``global_`` (over every rank) as in the names.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from dist_eval import chunks, ranks
from dist_eval.data.tokenize import trim_heap
from dist_eval.loop_facts import LoopFacts
from dist_eval.results import SAMPLE_VALUE_PREFIX, MergedResults, ShardResults, mapped_array
from dist_eval.scoring import main_report, score_intervals_everywhere


class CoverageError(RuntimeError):
    """Some rows were never evaluated, or an index lies outside the split."""


def _concat(payloads: List[dict], key: str) -> Optional[np.ndarray]:
    """One field of every payload, concatenated; the payloads let go of it (memory)."""
    parts = [p.pop(key, None) for p in payloads]
    if any(part is None for part in parts) or not parts:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def merge_gathered(payloads: List[dict], num_rows: int, rows: Optional[np.ndarray] = None) -> MergedResults:
    """Concatenate the ranks' payloads (:meth:`ShardResults.as_payload`; already
    concatenated by the gather, in which case there is one), keep the first result of each row index, and
    require exactly the rows 0..num_rows-1 (``rows``, sorted, when given: a shard's rows of the set).

    The payloads are consumed field by field (each field is released once it has been
    merged), so rank 0 holds about one copy of the gathered per-sample arrays, not two.

    Duplicates arise when a user DataLoader's DistributedSampler pads its last round;
    a duplicate must agree with the kept copy on the label (same row), or the data is
    inconsistent and we refuse to count it. The run's merge does this a range of row indices
    at a time (:func:`stream_to_main`), with the same rule.
    """
    coverage = _Coverage(num_rows, rows)
    merged = _merge_payloads(payloads, coverage)
    coverage.raise_if_incomplete()
    return merged


class _Coverage:
    """Which rows a merge found missing and which outside the set (or the shard), over ranges of
    row indices taken in ascending order: the counts and the first few of each, for the one error
    :meth:`raise_if_incomplete` raises at the end (the same words as one whole merge's).
    """

    def __init__(self, num_rows: int, rows: Optional[np.ndarray]):
        self.num_rows, self.rows = num_rows, rows
        self.distinct = self.missing = self.outside = 0
        self.first_missing: list = []
        self.first_outside: list = []
        self.inconsistent = False  # a row index arrived twice with different labels

    def check(self, unique_indices: np.ndarray, span: Optional[Tuple[int, int]] = None) -> None:
        """``unique_indices``: the distinct row indices found (sorted) of ``span`` [begin, end) (None: all)."""
        self.distinct += len(unique_indices)
        if self.rows is not None:
            expected = self.rows if span is None else self.rows[np.searchsorted(self.rows, span[0]):
                                                                np.searchsorted(self.rows, span[1])]
            if np.array_equal(unique_indices, expected):
                return
            missing, outside = np.setdiff1d(expected, unique_indices), np.setdiff1d(unique_indices, expected)
        else:
            low, high = (0, self.num_rows) if span is None else (max(span[0], 0), min(span[1], self.num_rows))
            size = max(high - low, 0)
            if len(unique_indices) == size and (
                    not size or (unique_indices[0] == low and unique_indices[-1] == high - 1)):
                return
            present = np.zeros(size, dtype=bool)
            present[unique_indices[(unique_indices >= low) & (unique_indices < high)] - low] = True
            missing = np.flatnonzero(~present) + low
            outside = unique_indices[(unique_indices < 0) | (unique_indices >= self.num_rows)]
        self.missing += len(missing)
        self.outside += len(outside)
        self.first_missing = (self.first_missing + missing[:5].tolist())[:5]
        self.first_outside = (self.first_outside + outside[:5].tolist())[:5]

    def raise_if_incomplete(self) -> None:
        if self.rows is not None and (self.missing or self.outside):
            raise CoverageError(f"evaluated {self.distinct} distinct rows, expected the shard's {len(self.rows)}: "
                                f"{self.missing} missing (first {self.first_missing}), {self.outside} outside the "
                                f"shard (first {self.first_outside})")
        if self.missing or self.outside:
            raise CoverageError(
                f"evaluated {self.distinct} distinct rows, expected {self.num_rows}: "
                f"{self.missing} missing (first {self.first_missing}), {self.outside} outside the split "
                f"(first {self.first_outside}). A DataLoader with drop_last=True, or a sampler that skips rows, "
                "causes this."
            )
        if self.inconsistent:
            raise CoverageError("the same row index arrived twice with different labels; the batches are inconsistent")


def _merge_payloads(payloads: List[dict], coverage: _Coverage, span: Optional[Tuple[int, int]] = None
                    ) -> MergedResults:
    """:func:`merge_gathered`'s merge of the rows of ``span`` (None: all), its coverage told to ``coverage``."""
    names = [k for k in payloads[0] if k.startswith(SAMPLE_VALUE_PREFIX)] if payloads else []
    indices = _concat(payloads, "indices") if payloads else np.zeros(0, np.int64)
    order = np.argsort(indices, kind="stable")
    sorted_indices = indices[order]
    del indices
    keep = np.ones(len(sorted_indices), dtype=bool)
    keep[1:] = sorted_indices[1:] != sorted_indices[:-1]
    num_duplicates = int((~keep).sum())
    unique_indices = sorted_indices[keep]
    del sorted_indices
    coverage.check(unique_indices, span)
    labels_sorted = _concat(payloads, "labels")[order] if payloads else np.zeros(0, np.int64)
    if num_duplicates:
        first_of_run = np.maximum.accumulate(np.where(keep, np.arange(len(keep)), 0))
        coverage.inconsistent |= bool(np.any(labels_sorted != labels_sorted[first_of_run]))
    labels = labels_sorted[keep] if num_duplicates else labels_sorted
    del labels_sorted
    selection = order[keep] if num_duplicates else order
    del order

    def pick(key: str) -> Optional[np.ndarray]:
        merged = _concat(payloads, key) if payloads else np.zeros(0, np.float64)
        return None if merged is None else merged[selection]

    preds = pick("preds")
    losses = pick("losses")
    logits = pick("logits")
    sample_values = {key[len(SAMPLE_VALUE_PREFIX) :]: pick(key) for key in names}
    return MergedResults(
        indices=unique_indices,
        labels=labels,
        preds=preds if preds is not None else np.zeros(0, np.int64),
        losses=losses if losses is not None else np.zeros(0, np.float64),
        logits=logits,
        sample_values=sample_values,
        num_duplicates_dropped=num_duplicates,
    )


class _MergedColumns:
    """Rank 0's merged rows, a range of row indices after another, in :func:`mapped_array`'s."""

    def __init__(self, payload: dict, capacity: int):
        self.columns = {key: mapped_array((capacity, *values.shape[1:]), values.dtype)
                        for key, values in payload.items()}
        self.count = self.duplicates = 0

    def add(self, part: MergedResults) -> None:
        stop = self.count + part.num_samples
        values = {"indices": part.indices, "labels": part.labels, "preds": part.preds, "losses": part.losses,
                  "logits": part.logits,
                  **{SAMPLE_VALUE_PREFIX + name: value for name, value in part.sample_values.items()}}
        for key, column in self.columns.items():
            column[self.count:stop] = values[key]
        self.count, self.duplicates = stop, self.duplicates + part.num_duplicates_dropped

    def merged(self) -> MergedResults:
        columns = {key: column[:self.count] for key, column in self.columns.items()}
        return MergedResults(
            indices=columns.pop("indices"), labels=columns.pop("labels"), preds=columns.pop("preds"),
            losses=columns.pop("losses"), logits=columns.pop("logits", None),
            sample_values={key[len(SAMPLE_VALUE_PREFIX):]: value for key, value in columns.items()},
            num_duplicates_dropped=self.duplicates)


def stream_to_main(local: ShardResults, num_rows: int, rows: Optional[np.ndarray] = None,
                   chunk_rows: Optional[int] = None) -> Optional[MergedResults]:
    """Every rank: its results sent to rank 0 a range of ``chunk_rows`` row indices at a time (by default
    ``dist_eval.chunks.chunk_rows("merge")``), in row order (a gather per range: no file system shared by
    the ranks is needed); rank 0 merges each range as :func:`merge_gathered` merges the whole (the first
    copy of a row kept: the lowest rank's, the first of its batches'), checks it covers the range's rows,
    and writes it to its merged columns (:func:`mapped_array`): the merged rows on rank 0 (memory maps),
    None elsewhere. Rank 0's heap holds one range's rows, the other ranks their own results. Every rank
    must call it.
    """
    payload = local.as_payload()
    order = np.argsort(payload["indices"], kind="stable")
    in_order = payload["indices"][order]
    main = ranks.is_main_process()
    bounds = _index_bounds(in_order, num_rows, rows if main else None, chunk_rows or chunks.chunk_rows("merge"))
    cuts = np.searchsorted(in_order, bounds)
    del in_order
    counts = ranks.all_reduce_sum(np.diff(cuts).astype(np.float64))  # every rank's rows in each range
    columns = _MergedColumns(payload, int(counts.sum())) if main else None
    coverage, failure = _Coverage(num_rows, rows), None
    for number, total in enumerate(counts.tolist()):
        span = (int(bounds[number]), int(bounds[number + 1]))
        gathered = None
        if total:  # a collective: every rank takes part, whatever rank 0's merge did
            picked = order[cuts[number]:cuts[number + 1]]
            gathered = ranks.gather_arrays_to_main({key: values[picked] for key, values in payload.items()})
        if main and failure is None:
            try:
                if gathered is None:
                    coverage.check(np.zeros(0, np.int64), span)
                else:
                    columns.add(_merge_payloads([gathered], coverage, span))
            except Exception as error:  # raised after the last range, so that no rank waits in a gather
                failure = error
    if failure is not None:
        raise failure
    if not main:
        return None
    coverage.raise_if_incomplete()
    return columns.merged()


def _index_bounds(in_order: np.ndarray, num_rows: int, rows: Optional[np.ndarray], chunk_rows: int) -> np.ndarray:
    """The ranges' bounds, the same on every rank: from the lowest row index any rank holds (or the
    set's first, 0 or the shard's) past the highest, ``chunk_rows`` apart.
    """
    expected = (rows[0], rows[-1] + 1) if rows is not None and len(rows) else (0, num_rows)
    mine = [int(in_order[0]), int(in_order[-1]) + 1] if len(in_order) else []
    if ranks.is_main_process():
        mine += [int(value) for value in expected]
    spans = [span for span in ranks.all_gather_object((min(mine), max(mine)) if mine else None) if span]
    if not spans:
        return np.zeros(1, dtype=np.int64)
    begin, end = min(s[0] for s in spans), max(s[1] for s in spans)
    return np.r_[np.arange(begin, end, chunk_rows, dtype=np.int64), end]


def merge_parts(parts: Sequence[MergedResults]) -> MergedResults:
    """One MergedResults of several merged parts of disjoint rows (the rounds of a run that
    stops early, their indices already the set's): every field of MergedResults, whatever it
    holds, ordered by row index as :func:`merge_gathered` orders them; arrays and each
    ``sample_values`` array concatenated, counts summed. A field of another kind is refused,
    so a field added to the merge cannot silently go missing here. The arrays: :func:`mapped_array`'s,
    filled a chunk of rows at a time (issue 51).
    """
    indices = np.concatenate([part.indices for part in parts])
    order = np.argsort(indices, kind="stable")
    del indices
    starts = np.cumsum([0] + [part.num_samples for part in parts])
    out = {}
    for name in (f.name for f in fields(MergedResults)):
        values = [getattr(part, name) for part in parts]
        if all(value is None for value in values):
            out[name] = None
        elif all(isinstance(value, np.ndarray) for value in values):
            out[name] = _in_order(values, order, starts)
        elif all(isinstance(value, dict) for value in values):
            out[name] = {key: _in_order([value[key] for value in values], order, starts) for key in values[0]}
        elif all(isinstance(value, int) for value in values):
            out[name] = sum(values)
        else:
            raise TypeError(f"MergedResults.{name}: expected arrays, dicts of arrays or counts in every part, "
                            f"got {sorted({type(value).__name__ for value in values})}; teach merge_parts it")
    return MergedResults(**out)


def _in_order(values: List[np.ndarray], order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``np.concatenate(values)[order]`` (``starts``: where each part begins in it) in a :func:`mapped_array`,
    a chunk of rows at a time: the concatenation is never made.
    """
    out = mapped_array((len(order), *values[0].shape[1:]), np.result_type(*values))
    step = chunks.chunk_rows("merge")
    for begin in range(0, len(order), step):
        wanted = order[begin:begin + step]
        part_of = np.searchsorted(starts, wanted, side="right") - 1
        chunk = np.empty((len(wanted), *out.shape[1:]), dtype=out.dtype)
        for number in np.unique(part_of).tolist():
            taken = part_of == number
            chunk[taken] = values[number][wanted[taken] - starts[number]]
        out[begin:begin + len(wanted)] = chunk
    return out


@dataclass
class Totals:
    """Sums over the ranks, reduced by one all_reduce: numerators and denominators are
    summed, and divided once (averaging per-rank means is wrong for uneven shards).
    """

    num_samples: float = 0.0
    loss_sum: float = 0.0
    num_truncated: float = 0.0
    forward_seconds: float = 0.0
    loop_cpu_seconds: float = 0.0  # client CPU of the rank's own process (not the p2pd daemons)

    @classmethod
    def of_shard(cls, local: ShardResults, num_truncated: int) -> Totals:
        return cls(
            local.num_samples, float(local.losses.sum()), num_truncated, local.forward_seconds, local.loop_cpu_seconds
        )

    def all_reduced(self) -> Totals:
        """The sums over every rank, on every rank (a collective)."""
        return Totals(*ranks.all_reduce_sum(np.array(astuple(self), dtype=np.float64)).tolist())


@dataclass
class RankFacts:
    """One rank's facts for the report, all-gathered (not summed)."""

    num_samples: int
    loop_seconds: float
    max_batch_seconds: float
    num_resumed: int


class MainMerge(NamedTuple):
    """What :func:`merge_on_main` gives every rank."""

    report: dict  # the metrics and intervals of the merged rows, with the loop's facts (every rank)
    merged: Optional[MergedResults]  # the merged per-sample arrays: rank 0's; None elsewhere
    facts: LoopFacts  # the loop over every rank, as the report says it (every rank)


def merge_on_main(
    local: ShardResults,
    num_rows: int,
    num_labels: int,
    *,
    label_names: Optional[Sequence[str]] = None,
    user_metrics: Optional[Dict[str, Callable]] = None,
    num_truncated: int = 0,
    loop_seconds: float = 0.0,
    bootstrap: Optional[Tuple[int, int]] = None,
    top_k: Optional[int] = None,
    rows: Optional[np.ndarray] = None,
) -> MainMerge:
    """Combine every rank's results: the report and the loop's facts on every rank, the merged
    per-sample arrays on rank 0 (:class:`MainMerge`). Every rank must call it.

    ``bootstrap`` = (resamples, seed) adds ``confidence_intervals`` to the report.
    ``top_k``: the k of ``top{k}_accuracy`` (None: :func:`dist_eval.metrics.default_top_k`).
    ``local.logits`` must be kept: the probability scores (ECE, Brier, top-k, AUROC) are
    computed on rank 0 from the softmax of every row's logits. ``rows``: the rows of a shard
    (sorted), which the merge must cover instead of 0..num_rows-1.
    """
    global_totals = Totals.of_shard(local, num_truncated).all_reduced()
    rank_facts = ranks.all_gather_object(
        RankFacts(local.num_samples, loop_seconds, local.max_batch_seconds, local.num_resumed)
    )
    report, probs = None, None
    with ranks.phase("merging the results"):
        # per-sample arrays to rank 0 only, a range of rows at a time; rank 0 merges and computes the metrics
        merged = stream_to_main(local, num_rows, rows)
        _let_go(local)
        if ranks.is_main_process():
            report, probs = _report(merged, num_labels, label_names, user_metrics, global_totals, (bootstrap, top_k))
    report, duplicates = ranks.broadcast_object((report, 0 if merged is None else merged.num_duplicates_dropped))
    cost = score_intervals_everywhere(report, None if merged is None else merged.labels, probs, bootstrap)
    del probs  # rank 0's probabilities, of every row: let go before the heap is trimmed below
    facts = LoopFacts(
        world_size=len(rank_facts),
        per_rank_samples=[rank.num_samples for rank in rank_facts],
        eval_loop_seconds=max(rank.loop_seconds for rank in rank_facts),
        forward_seconds_sum=global_totals.forward_seconds,
        loop_cpu_seconds_sum=global_totals.loop_cpu_seconds,
        duplicates_dropped=duplicates,
        max_batch_seconds=max(rank.max_batch_seconds for rank in rank_facts),
        resumed_samples=sum(rank.num_resumed for rank in rank_facts),
        num_truncated=int(global_totals.num_truncated),
        exact_score_intervals=cost,
    )
    report.update(facts.report())  # the row store's facts: the evaluation's (dist_eval.known) adds them
    trim_heap()  # the merge's and the metrics' temporaries: given back, not left to the next phases' peaks
    return MainMerge(report, merged, facts)


def _let_go(local: ShardResults) -> None:
    """The rank's own per-sample arrays, merged now: emptied, so that the caller's reference holds none."""
    local.indices, local.labels = local.indices[:0].copy(), local.labels[:0].copy()  # copies: a view holds its base
    local.preds, local.losses = local.preds[:0].copy(), local.losses[:0].copy()
    local.logits = None if local.logits is None else local.logits[:0].copy()
    local.sample_values = {name: values[:0].copy() for name, values in local.sample_values.items()}


def _report(merged: MergedResults, num_labels, label_names, user_metrics, totals: Totals, scoring) -> tuple:
    """Rank 0: the report of the merged set and the probabilities of its rows
    (:func:`dist_eval.scoring.main_report`), checked against the reduced totals.
    ``scoring``: (bootstrap (resamples, seed) or None, top_k).
    """
    if merged.num_samples != int(totals.num_samples):
        raise RuntimeError(
            f"internal: all_reduce counted {int(totals.num_samples)} samples but the merge holds {merged.num_samples}"
        )
    report, probs = main_report(merged, num_labels, label_names, user_metrics, scoring)
    reduced_loss = totals.loss_sum / merged.num_samples
    if abs(reduced_loss - report["loss"]) > 1e-9 * max(1.0, abs(report["loss"])):
        raise RuntimeError(f"internal: all_reduced mean loss {reduced_loss} != merged mean loss {report['loss']}")
    return report, probs


if __name__ == "__main__":  # python -m dist_eval.merge SHARD_DIR... --output-dir OUT (issue 53's name for it)
    import runpy

    # the program is the shards' merge, run as `dist-eval merge` hands it on (dist_eval.launcher); this
    # module, the ranks' merge under it, imports nothing of it
    runpy.run_module("dist_eval.shard_merge", run_name="__main__", alter_sys=True)
