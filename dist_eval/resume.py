"""Resuming an interrupted run: partial results on disk, the run key, and what is reused.

Each rank appends the logits of the batches it finished to ``<dir>/<run key>/``, one
small ``.npz`` file per flush, written to a temporary name and renamed into place: a
reader sees a whole file or none. A batch is identified by its id in the global batch
plan, which depends only on the data and the settings, never on the world size; so a
run restarted with another number of ranks still finds every stored batch.

The run key is a hash of everything that decides a batch's logits: the model folder
(its config and the names, sizes and modification times of its weight files), the
checkpoint's bytes, the data's fingerprint, the loaded model's facts, every field of
:class:`dist_eval.config.Settings`, the versions of the libraries that compute a row
(:data:`dist_eval.backends.provenance.KEYED_LIBRARIES`, as the row store's key) and dist_eval's own, with its
code's digest. Stored results under another key are never mixed in: the run says so and removes them.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import re
import shutil
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from dist_eval import ranks
from dist_eval.atomic import atomic_write, file_sha256, read_regular
from dist_eval.errors import warn
from dist_eval.loop_facts import RunFacts

SUBDIR = "partial"
# A partial-results file's size bound (one flush of a rank's batches, every save interval)
MAX_PARTIAL_BYTES = 4 << 30


def _file_facts(folder: str) -> List[Tuple[str, int, int]]:
    facts = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            stat = os.stat(path)
            facts.append((name, stat.st_size, int(stat.st_mtime)))
    return facts


def run_key(
    model_dir: str, checkpoint: Optional[str], dataset, split: Optional[str], model, settings,
    head: Optional[str] = None, libraries: bool = True,
) -> str:
    """A short hash of what decides the results: the model folder's files, the checkpoint,
    the data, the loaded model (a :class:`dist_eval.backends.LoadedModel`), every field of
    ``settings`` (a :class:`dist_eval.config.Settings`), the installed libraries' versions and dist_eval's own
    with its code's digest (:func:`~dist_eval.backends.provenance.dist_eval_version`). Weights are identified by
    name, size and mtime, not hashed: hashing a 100 GB model at every start would cost minutes.
    ``libraries=False``: the versions left out (the shards' merge compares them itself, naming the package:
    :func:`dist_eval.shard_merge.check_versions`).
    """
    from dist_eval.backends.checkpoint import checkpoint_digest  # a file's bytes; a PEFT adapter's two files
    from dist_eval.backends.provenance import dist_eval_version, library_versions

    facts = {
        "model_files": _file_facts(model_dir),
        "checkpoint_sha256": checkpoint_digest(checkpoint) if checkpoint else None,
        "data": data_fingerprint(dataset),
        "split": split,
        "model": {"backend": model.backend, "num_labels": model.num_labels, "prompt_tokens": model.prompt_tokens,
                  "device": device_kind(model)},
        "settings": settings.as_dict(),
    }
    if libraries:  # rank 0's (the key is broadcast): a resumed run on another torch, transformers, ... mixes no row
        facts["libraries"] = {**library_versions(), "dist_eval": dist_eval_version()}
    if head:  # a checkpoint's separate head (--head): a file, or a model folder
        facts["head"] = _file_facts(head) if os.path.isdir(head) else file_sha256(head)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def device_kind(model) -> str:
    """'cpu' or 'cuda': where the model's weights are (GPU kernels round floats otherwise)."""
    parameters = getattr(getattr(model, "module", None), "parameters", None)
    first = next(iter(parameters()), None) if parameters is not None else None
    return first.device.type if first is not None else "cpu"


def resume_folder(output_dir: str, key: str, resume: bool, say: Callable[..., None]) -> str:
    """Rank 0: the folder for this run's partial results (``<output_dir>/partial/<key>``).

    Partial results of another model, checkpoint, data or settings are never mixed in:
    they are removed, and the run says so. With ``resume=False`` everything stored is removed.
    """
    folder = os.path.join(output_dir, SUBDIR, key)
    stale = stale_runs(output_dir, key) + ([folder] if not resume and os.path.isdir(folder) else [])
    if stale:
        why = ("--no-resume" if not resume else
               "made by another model, checkpoint, data or settings, or by other code or libraries")
        # a warning, shown in --quiet mode too: stored work is being thrown away
        warn(f"removing stored partial results ({why}): {', '.join(stale)}; starting clean")
        remove(stale)
    elif os.path.isdir(folder):
        say(f"dist_eval: resuming: reusing the stored results in {folder}", flush=True)
    os.makedirs(folder, exist_ok=True)
    return folder


def finished(folder: str) -> None:
    """The report is complete: the partial results have served; remove them."""
    remove([folder])
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(folder))


def finished_report(folder: str, key: str, compared_with: Optional[str] = None) -> bool:
    """``folder`` holds the complete report of the run ``key``: its metrics.json records the
    key, predictions.jsonl is there and no partial results are left (they are removed last).
    ``compared_with``: the run key of the other side of a comparison, which the report must name
    (its stop was decided against that side's rows).
    """
    try:
        with open(os.path.join(folder, "metrics.json")) as f:
            recorded = RunFacts.of(json.load(f))
    except (OSError, ValueError, AttributeError, TypeError):  # no report, or not one
        return False
    partner = recorded.pair.get("compared_with_run_key") if isinstance(recorded.pair, dict) else None
    return (recorded.run_key == key and partner == compared_with
            and os.path.isfile(os.path.join(folder, "predictions.jsonl"))
            and not os.path.isdir(os.path.join(folder, SUBDIR, key)))


def stored_results(output_dirs: Sequence[str], key_facts: Sequence[tuple], *, resume: bool, skip_finished: bool,
                   say: Callable[..., None]) -> List[Tuple[Optional[str], str, Optional[str]]]:
    """Every rank: for each run evaluated together (one, or the two compared on the same rows), (the folder of
    its partial results in its ``output_dirs`` entry, its run key, the run key of the other side of a
    comparison or None), found by rank 0 in a phase and sent to every rank. The folders are None when every
    one of those output folders holds the finished report of its very run and ``skip_finished`` (the run
    says so: skipped); a comparison's reports must name each other's run key. In a comparison with one side
    finished, that side is evaluated again beside the other (the rounds need both sides' rows), and the run
    says so. ``key_facts``: each run's arguments of :func:`run_key`; ``resume``: False removes what is
    stored (:func:`resume_folder`).
    """
    with ranks.phase("finding the stored partial results"):
        found = None
        if ranks.is_main_process():
            keys = [run_key(*facts) for facts in key_facts]
            partners = list(reversed(keys)) if len(keys) > 1 else [None]  # a comparison: each names the other
            finished = [skip_finished and resume and finished_report(out, key, partner)
                        for out, key, partner in zip(output_dirs, keys, partners)]
            if all(finished):
                for out in output_dirs:
                    say(f"dist_eval: already finished (the report in {out} is of this checkpoint, data and "
                        "settings): skipped", flush=True)
                folders = [None] * len(keys)
            else:
                for out in (out for out, done in zip(output_dirs, finished) if done):
                    say(f"dist_eval: the report in {out} is finished, but the checkpoint it is compared with is "
                        "not: it is evaluated again beside it, on the same rows", flush=True)
                folders = [resume_folder(out, key, resume, say) for out, key in zip(output_dirs, keys)]
            found = list(zip(folders, keys, partners))
    return ranks.broadcast_object(found)


def data_fingerprint(dataset) -> str:
    """The ``datasets`` fingerprint (derived from the source files' content) and size."""
    return f"{getattr(dataset, '_fingerprint', None)}:{len(dataset)}:{dataset.column_names}"


def stale_runs(root: str, key: str) -> List[str]:
    """Folders of partial results made by another model, checkpoint, data or settings (or code or libraries): only what
    dist_eval writes there (a folder named by a run key, holding its ranks' files and nothing
    else); a folder of the user's under ``partial/`` is left alone.
    """
    return [p for p in glob.glob(os.path.join(root, SUBDIR, "*"))
            if os.path.basename(p) != key and not os.path.islink(p) and os.path.isdir(p) and _is_partial_folder(p)]


def _is_partial_folder(path: str) -> bool:
    if not re.fullmatch(r"[0-9a-f]{16}", os.path.basename(path)):
        return False
    with contextlib.suppress(OSError):
        return all(_PARTIAL_FILE.fullmatch(name) for name in os.listdir(path))
    return False


# a rank's flush (rank<r>-<pid>-<n>.npz) and the hidden temporary file of one in progress
_PARTIAL_FILE = re.compile(r"rank\d+-\d+-\d+\.npz|\.rank\d+-\d+-\d+\.npz\.tmp\d+-[0-9a-f]+")


def remove(paths: Iterable[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def load(folder: str, wanted_batches: Iterable[int]) -> Tuple[Dict[int, tuple], Dict[str, dict]]:
    """({batch id: (row indices, logits, its swarm servers)} of the stored batches among ``wanted_batches``,
    the servers the swarm audit had blamed when the files were written, with the evidence): a batch any of
    those answered is left out (evaluated again). Files are read oldest first: a batch's newest copy wins
    (one evaluated again after a blame).
    """
    wanted = set(int(b) for b in wanted_batches)
    found: Dict[int, tuple] = {}
    blamed: Dict[str, dict] = {}
    skipped: List[str] = []
    for path in sorted(glob.glob(os.path.join(folder, "*.npz")), key=_age):
        try:
            batch_ids, offsets, rows, logits, servers, file_blamed = _read_partial(path)
        except Exception as e:  # whatever a cut, planted or foreign file raises: its batches run again
            skipped.append(f"{os.path.basename(path)} ({type(e).__name__}: {e})")
            continue
        blamed.update(file_blamed)
        for i, b in enumerate(batch_ids.tolist()):
            if b in wanted:
                found[b] = (rows[offsets[i] : offsets[i + 1]], logits[offsets[i] : offsets[i + 1]], servers[i])
    if skipped and ranks.is_main_process():  # every rank reads every file: one line, rank 0's
        warn(f"resume: skipped {len(skipped)} file(s) of partial results in {folder} that are not whole "
             f"(first: {skipped[0]}); their batches are evaluated again")
    return {b: hit for b, hit in found.items() if not blamed.keys() & set(hit[2])}, blamed


def _age(path: str) -> tuple:
    with contextlib.suppress(OSError):
        return os.stat(path).st_mtime_ns, path
    return 0, path


def _read_partial(path: str) -> tuple:
    """(batch ids, offsets, rows, logits) of one partial-results file: a regular file this user
    owns, of at most MAX_PARTIAL_BYTES (never a FIFO or a device: no hang, no unbounded read),
    whole, with finite logits; else an exception saying what it is.
    """
    with np.load(io.BytesIO(read_regular(path, MAX_PARTIAL_BYTES, owner=os.geteuid())), allow_pickle=False) as f:
        batch_ids, offsets, rows, logits = (np.asarray(f[name]) for name in ("batch_ids", "offsets", "rows", "logits"))
        # a swarm run's: each batch's servers and the servers blamed at the flush (JSON); none in older files
        servers = [tuple(json.loads(str(s))) for s in f["servers"]] if "servers" in f.files else \
            [()] * len(batch_ids)
        blamed = json.loads(str(f["blamed"])) if "blamed" in f.files else {}
    if offsets.shape != (len(batch_ids) + 1,) or offsets[-1] != len(rows) or len(logits) != len(rows):
        raise ValueError("its arrays do not agree")
    if len(servers) != len(batch_ids) or not isinstance(blamed, dict) or \
            not all(isinstance(p, str) for s in servers for p in s):
        raise ValueError("its servers do not agree")
    if not np.isfinite(logits).all():
        raise ValueError("non-finite logits")
    return batch_ids, offsets, rows, logits, servers, blamed


class PartialWriter:
    """Collects finished batches of one rank and writes them atomically, at most every
    ``interval`` seconds (0: after every batch) and at :meth:`flush`.
    """

    def __init__(self, folder: str, rank: int, interval: float):
        self.folder, self.rank, self.interval = folder, rank, interval
        os.makedirs(folder, exist_ok=True)
        self._pending: List[Tuple[int, np.ndarray, np.ndarray, tuple]] = []
        self._ledgers: Dict[int, object] = {}  # the swarm audits of the batches added: their blamed servers
        self._last_flush = time.monotonic()
        self._sequence = len(glob.glob(os.path.join(folder, f"rank{rank}-*.npz")))

    def add(self, batch_id: int, rows: np.ndarray, logits: np.ndarray, servers=(), ledger=None) -> None:
        """A batch done (``servers``: the swarm servers its logits come from; ``ledger``: their audit's)."""
        self._pending.append((batch_id, rows, logits, tuple(sorted(servers))))
        if ledger is not None:
            self._ledgers.setdefault(id(ledger), ledger)
        if time.monotonic() - self._last_flush >= self.interval:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        lengths = [len(rows) for _, rows, _, _ in self._pending]
        payload = {
            "batch_ids": np.array([b for b, _, _, _ in self._pending], dtype=np.int64),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "rows": np.concatenate([rows for _, rows, _, _ in self._pending]).astype(np.int64),
            "logits": np.concatenate([logits for _, _, logits, _ in self._pending]).astype(np.float32),
        }
        if self._ledgers or any(servers for *_, servers in self._pending):
            blamed: Dict[str, dict] = {}
            for ledger in self._ledgers.values():
                with ledger.lock:
                    blamed.update(ledger.excluded)
            payload["servers"] = np.array([json.dumps(list(servers)) for *_, servers in self._pending])
            payload["blamed"] = np.array(json.dumps(blamed, sort_keys=True, default=str))
        # a new name per flush (never overwritten; the pid in it: a restarted rank never
        # collides with a dead one's leftovers)
        final = os.path.join(self.folder, f"rank{self.rank}-{os.getpid()}-{self._sequence:06d}.npz")
        # a machine crash may lose the last flushes, which are then simply re-run
        atomic_write(final, lambda f: np.savez(f, **payload), binary=True)
        self._sequence += 1
        self._pending.clear()
        self._last_flush = time.monotonic()


def stored_logits(folder: str, own_batches: Dict[int, np.ndarray], num_labels: int) -> tuple:
    """({batch id: logits}, {batch id: its swarm servers}) of this rank's batches that an interrupted run
    stored, and the servers blamed then (:func:`load`). A stored batch whose rows or shape do not match
    the plan is ignored (run again), never used.
    """
    stored, servers = {}, {}
    found, blamed = load(folder, own_batches)
    for batch_id, (rows, logits, by) in found.items():
        if np.array_equal(rows, own_batches[batch_id]) and logits.shape == (len(rows), num_labels):
            stored[batch_id], servers[batch_id] = logits, by
    return stored, servers, blamed


def open_partial(
    folder: Optional[str], own_batches: Optional[Dict[int, np.ndarray]], num_labels: int, save_interval: float
) -> tuple:
    """(the stored logits of this rank's batches, their swarm servers, the servers blamed when they were
    stored, a writer for the new ones); ({}, {}, {}, None) without a folder, or for a DataLoader (whose
    batches have no global plan).
    """
    if folder is None or own_batches is None:
        return {}, {}, {}, None
    return (*stored_logits(folder, own_batches, num_labels), PartialWriter(folder, ranks.get_rank(), save_interval))
