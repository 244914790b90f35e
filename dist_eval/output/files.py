"""The run's files, written by rank 0 only: metrics.json, predictions.jsonl and the readable
report (per_class.csv / .md, confusion_matrix.png, report.html).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import shutil
import socket
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from dist_eval.atomic import atomic_create, atomic_write
from dist_eval.chunks import chunk_rows
from dist_eval.errors import UsageError, warn
from dist_eval.output.slice_lines import slices_csv
from dist_eval.receipt import jsonable
from dist_eval.results import MergedResults


def check_output_dir(path: str) -> None:
    """Fail before any work when the report could not be written."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".dist_eval_write_test_{os.getpid()}")
        atomic_write(probe, "ok")  # as the report's files are written: a temporary file renamed into place
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--output-dir {path}: not writable ({e.strerror}). Pass a folder you can write to.") from e


def prepare_pair_folders(output_dir: str, folders: Sequence[str]) -> None:
    """Rank 0, before any work: each pair's folder in ``output_dir`` writable (:func:`check_output_dir`),
    an earlier shard's files there removed: they are not this run's
    (:func:`~dist_eval.output.shard_files.discard_shard`).
    """
    from dist_eval.output.shard_files import discard_shard

    for folder in folders:
        path = os.path.join(output_dir, folder)
        check_output_dir(path)
        discard_shard(path)


# One run at a time per output folder: rank 0 of the run holding it keeps this file there
LOCK_NAME = ".dist_eval.lock"
_held: Dict[str, str] = {}  # {folder: lock file} held by this process


def hold_output_dir(path: str) -> None:
    """Rank 0: take ``path`` for this run, or refuse in one line naming the run that holds it
    (host, pid, start). A lock left by a run that died on this host is taken over with a warning
    (one that died on another host cannot be seen dead from here: its file must be removed by hand,
    but for a SLURM job requeued onto another node: its earlier run's lock is taken over).
    Released when this process exits.
    """
    lock = os.path.join(os.path.abspath(path), LOCK_NAME)
    if lock in _held.values():
        return
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
          "slurm_job": os.environ.get("SLURM_JOB_ID"), "restarts": os.environ.get("SLURM_RESTART_COUNT")}
    for _ in range(3):  # another run may take over the same dead lock at the same moment
        try:  # whole or absent to a reader: a lock half written (read as unreadable) is never seen
            atomic_create(lock, lambda f: json.dump(me, f))
        except FileExistsError:
            other = _lock_holder(lock)
            if not _earlier_run_of_this_job(other, me) and (other.get("host") != me["host"] or _alive(other)):
                who = (f"host {other.get('host', '?')}, pid {other.get('pid', '?')}, since {other.get('since', '?')}"
                       if other else "unreadable lock")
                raise UsageError(f"in use by another run ({who}). Pass another --output-dir, or wait for that run "
                                 f"to end (if it died on another host, remove {lock}).",
                                 param="output_dir", value=path) from None
            warn(f"--output-dir {path}: taking over the lock of a run that died (pid {other.get('pid')}, since "
                 f"{other.get('since')})")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
            continue
        _held[path] = lock
        if len(_held) == 1:
            atexit.register(release_output_dirs)
        return
    raise UsageError("another run keeps taking its lock; try again.", param="output_dir", value=path)


def _earlier_run_of_this_job(other: dict, me: dict) -> bool:
    """The lock's run is this SLURM job's before it was requeued (preempted, a node lost, scontrol
    requeue: the same job id, fewer restarts), on whichever node: it has ended.
    """
    try:
        return bool(me["slurm_job"]) and other.get("slurm_job") == me["slurm_job"] and \
            int(other.get("restarts") or 0) < int(me["restarts"] or 0)
    except (TypeError, ValueError):
        return False


def release_output_dirs() -> None:
    """Remove the locks this process holds (at the end of the run, and at exit)."""
    for path, lock in list(_held.items()):
        if _lock_holder(lock).get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(lock)
        del _held[path]


def _lock_holder(lock: str) -> dict:
    from dist_eval.atomic import read_regular

    try:
        holder = json.loads(read_regular(lock, 4096))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _process_start(pid: int) -> Optional[int]:
    """A process's start time in clock ticks since boot (tells a live pid from a reused one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """The lock's run still runs on this host: its pid lives and started when the lock says."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return holder.get("started") is None or _process_start(pid) == holder.get("started")


def write_metrics(output_dir: str, metrics: dict) -> str:
    path = os.path.join(output_dir, "metrics.json")
    return atomic_write(path, lambda f: json.dump(metrics, f, indent=2, sort_keys=False, default=jsonable))


def write_predictions(
    output_dir: str,
    merged: MergedResults,
    label_names: Optional[Sequence[str]] = None,
    save_logits: bool = False,
    texts: Optional[Dict[str, Sequence[str]]] = None,
) -> str:
    """One JSON object per row of the split, in row order: ``index``, ``label``, ``pred``
    (and their names), ``prob`` (the softmax probability of ``pred``, when the logits are
    there), ``loss`` (the row's cross-entropy), ``logits`` with ``save_logits``, and each
    of ``texts`` ({key: one text per row, in row order}, e.g. {"text": [...]}).
    """
    from dist_eval.metrics import softmax

    path = os.path.join(output_dir, "predictions.jsonl")
    indices = merged.indices
    logits = merged.logits if save_logits else None
    names = [json.dumps(name) for name in label_names] if label_names else None
    # each column: its key and what makes its cells of the rows [start, stop), a chunk at a time
    columns: list = [("index", lambda a, b: _json_ints(indices[a:b].tolist())),
                     ("label", lambda a, b: _json_ints(merged.labels[a:b].tolist())),
                     ("pred", lambda a, b: _json_ints(merged.preds[a:b].tolist()))]
    if names:
        columns += [("label_name", lambda a, b: list(map(names.__getitem__, merged.labels[a:b].tolist()))),
                    ("pred_name", lambda a, b: list(map(names.__getitem__, merged.preds[a:b].tolist())))]
    if merged.logits is not None:  # softmax is row by row: a chunk's rows get the bits of the whole array's
        columns.append(("prob", lambda a, b: _json_floats(
            softmax(merged.logits[a:b])[np.arange(b - a), merged.preds[a:b]].tolist())))
    columns.append(("loss", lambda a, b: _json_floats(merged.losses[a:b].tolist())))
    if logits is not None:
        columns.append(("logits", lambda a, b: ["[" + ", ".join(_json_floats(row)) + "]"
                                                for row in logits[a:b].tolist()]))
    for key, values in (texts or {}).items():
        if hasattr(values, "json_cells"):  # made at once (HexKeys: the content keys)
            text_column = (key, lambda a, b, values=values: values.json_cells(np.asarray(indices[a:b])))
        else:
            text_column = (key, lambda a, b, values=values: [json.dumps(values[i]) for i in indices[a:b].tolist()])
        taken = [position for position, (name, _) in enumerate(columns) if name == key]
        if taken:  # a dict keeps the first place of a key given twice, with the last value
            columns[taken[0]] = text_column
        else:
            columns.append(text_column)
    # each line as json.dumps(row) writes it, the keys in this order, built a column at a
    # time: a dict and a json.dumps per row were most of the report's time on big sets; a
    # chunk of rows at a time, so that the file's text is never held whole
    separators = ["{" + json.dumps(columns[0][0]) + ": "] + [", " + json.dumps(key) + ": " for key, _ in columns[1:]]
    separators.append("}\n")

    def write_rows(f, start: int, stop: int) -> None:
        chunk = chunk_rows("lines")
        for first in range(start, stop, chunk):
            last = min(first + chunk, stop)
            f.write(_interleaved(separators, [cells(first, last) for _, cells in columns], last - first))

    def write(f):
        if len(indices) < chunk_rows("aside"):
            write_rows(f, 0, len(indices))
        else:
            _second_half_aside(f, path, write_rows, len(indices))

    return atomic_write(path, write)


def _second_half_aside(f, path: str, write_rows: Callable, rows: int) -> None:
    """Rows [0, rows // 2) written to ``f`` here while a forked child (:class:`dist_eval.aside.Aside`) writes the
    others to a hidden file beside ``path``, then appended: the lines' formatting (two floats' repr a row, most of
    the report's time on a big set) on two cores. A child that fails leaves its rows to be written here.
    """
    from dist_eval.aside import AsideFailed, started
    from dist_eval.atomic import scratch_beside

    half = rows // 2
    fd, tail = scratch_beside(path, "tail")
    try:
        def write_second_half():  # in the child
            with os.fdopen(os.dup(fd), "w", encoding="utf-8") as t:
                write_rows(t, half, rows)

        child = started(write_second_half)
        if child is None:  # no child to be had: every row here
            write_rows(f, 0, rows)
            return
        with child:
            began = time.monotonic()
            write_rows(f, 0, half)
            try:  # the same work as this process's half: a child far slower than that is stuck (killed)
                child.result(timeout=max(60.0, 4 * (time.monotonic() - began)))
            except AsideFailed:  # what it wrote, whole or not, is never read
                write_rows(f, half, rows)
                return
        f.flush()
        os.lseek(fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(fd), "rb") as written:
            shutil.copyfileobj(written, f.buffer, 1 << 24)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tail)


def _interleaved(separators: List[str], columns: List[list], rows: int) -> str:
    """Row after row, each row's cells of ``columns`` between ``separators`` (one more than the columns): the
    pieces laid out in one list by slice assignment and joined once, at C speed (a ``%`` template per row took
    twice as long).
    """
    width = 2 * len(columns) + 1
    pieces: list = [None] * (rows * width)
    for j, cells in enumerate(columns):
        pieces[2 * j::width] = [separators[j]] * rows
        pieces[2 * j + 1::width] = cells
    pieces[width - 1::width] = [separators[-1]] * rows
    return "".join(pieces)


class ColumnCells:
    """A dataset column's cells by row index, read a chunk of rows at a time as they are asked for
    (in row order, as predictions.jsonl is written: each chunk read once), not the column held whole;
    ``chunk``: by default predictions.jsonl's, ``chunk_rows("lines")``.
    """

    def __init__(self, dataset, column: str, chunk: Optional[int] = None):
        self.dataset, self.column, self.chunk = dataset, column, chunk or chunk_rows("lines")
        self.start, self.cells = 0, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        if not self.start <= i < self.start + len(self.cells):
            if not 0 <= i < len(self.dataset):
                raise IndexError(i)
            self.start = i
            self.cells = self.dataset.select_columns([self.column])[i:i + self.chunk][self.column]
        return self.cells[i - self.start]


class RowSlices:
    """Each row's ``{column: slice name}`` of ``{column: each row's slice name}``, made as it is asked for."""

    def __init__(self, slices: Dict[str, Sequence[str]]):
        self.slices = slices

    def __len__(self) -> int:
        return len(next(iter(self.slices.values()), ()))

    def __getitem__(self, i: int) -> dict:
        return {column: values[i] for column, values in self.slices.items()}


def _json_ints(values: list) -> List[str]:
    return list(map(int.__repr__, values))


def _json_floats(values: list) -> List[str]:
    """Each float as json.dumps writes it: repr, or NaN / Infinity / -Infinity."""
    texts = list(map(float.__repr__, values))
    if all(map(math.isfinite, values)):  # the rule: only the rare non-finite rows need a look-up each
        return texts
    special = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
    return [special.get(text, text) for text in texts]


def write_report_files(output_dir: str, metrics: dict, warn: Callable[[str], None] = warn,
                       drawn: Optional[Dict[str, object]] = None) -> List[str]:
    """per_class.csv, per_class.md, slices.csv (with ``slices``), confusion_matrix.png,
    reliability_diagram.png and report.html; returns their paths. ``drawn``: :func:`draw_figures`'
    result, made beforehand (else drawn here).

    Without matplotlib the figure is skipped with one ``warn`` line and report.html
    shows the matrix as a table instead.
    """
    from dist_eval.output.html import render_html
    from dist_eval.output.per_class import per_class_csv, per_class_markdown

    written = []

    def text_file(name: str, text: str) -> None:
        path = os.path.join(output_dir, name)
        atomic_write(path, text)
        written.append(path)

    text_file("per_class.csv", per_class_csv(metrics))
    text_file("per_class.md", per_class_markdown(metrics))
    if metrics.get("slices"):
        text_file("slices.csv", slices_csv(metrics))
    drawn = draw_figures(metrics) if drawn is None else drawn
    png = drawn.get("confusion_matrix.png")
    if png is None:
        warn("matplotlib is not installed, so confusion_matrix.png was not written (pip install matplotlib); "
             "report.html shows the matrix as a table")
    elif isinstance(png, str):  # a figure must not cost the user the rest of the report
        warn(f"confusion_matrix.png could not be drawn ({png}); report.html shows the matrix as a table")
    reliability = drawn.get("reliability_diagram.png")
    if isinstance(reliability, str):
        warn(f"reliability_diagram.png could not be drawn ({reliability})")
    for name, figure in (("confusion_matrix.png", png), ("reliability_diagram.png", reliability)):
        if isinstance(figure, bytes):
            path = os.path.join(output_dir, name)
            atomic_write(path, figure)
            written.append(path)
    text_file("report.html", render_html(metrics, png if isinstance(png, bytes) else None,
                                         reliability_png=reliability if isinstance(reliability, bytes) else None))
    for name in REPORT_FILES:  # an earlier run's file this run does not write must not look current
        path = os.path.join(output_dir, name)
        if path not in written:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return written


def draw_figures(metrics: dict) -> Dict[str, object]:
    """The report's figures of ``metrics`` (its aggregates alone): {file name: the PNG's bytes, None (no
    matplotlib), or the error drawing it raised, "Type: message"}; the reliability diagram only where metrics.json
    has its table.
    """
    from dist_eval.output.figures import confusion_matrix_png, reliability_table_png
    from dist_eval.output.per_class import class_names

    title = f"{metrics['num_samples']} samples, accuracy {metrics['accuracy']:.4f}, macro F1 {metrics['f1_macro']:.4f}"
    drawn: Dict[str, object] = {"confusion_matrix.png": _drawn(
        lambda: confusion_matrix_png(metrics["confusion_matrix"], class_names(metrics), title=title))}
    if metrics.get("reliability"):  # None without matplotlib: said once, for the confusion matrix
        drawn["reliability_diagram.png"] = _drawn(lambda: reliability_table_png(metrics["reliability"], metrics["ece"]))
    return drawn


def _drawn(draw: Callable[[], Optional[bytes]]):
    try:
        return draw()
    except Exception as e:  # a figure must not cost the user the rest of the report
        return f"{type(e).__name__}: {e}"


# every file write_report_files may write
REPORT_FILES = ("per_class.csv", "per_class.md", "slices.csv", "confusion_matrix.png", "reliability_diagram.png",
                "report.html")
