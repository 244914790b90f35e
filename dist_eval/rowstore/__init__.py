"""The row store (issue 38): every row a run evaluates, kept for every later run to reuse.

A row costs GPU time on a swarm; the same model and checkpoint are evaluated again and again
(``--limit 500``, then 5000, then every row; a narrower ``--stop-at-width``; another metric; a
new ``--output-dir``). The store keeps each evaluated row's logits under a key of everything
that decides them, and a run reads the rows it can and evaluates only the others.

Layout (one tree, safe to delete whole or in part at any time)::

    <root>/<model key>/<task key>/key.json                   what the two keys are made of
    <root>/<model key>/<task key>/<run>-r<rank>-<n>.rows     rows, written once, never changed

``<root>``: ``--row-store DIR`` (API ``row_store=``), by default ``$DIST_EVAL_CACHE/rows``
(``~/.cache/dist_eval/rows``; the environment variable ``DIST_EVAL_ROW_STORE`` names another
default, or ``off``). The model key hashes the model's identity (the files' content, a hub
snapshot's commit: :func:`~dist_eval.backends.provenance.folder_identity`) and the numerics
(backend, dtype, device, the versions of every library that can change a row's tokens or logits:
:data:`KEYED_LIBRARIES`, the swarm servers' versions, dtypes, quantization); the task key
the checkpoint's prompts and head (their tensors' bytes), the tokenizer's content, every setting
that changes a row's tokens or logits (``--max-length``, template, label words, columns). Each
row is then keyed by a hash of its own text (and text pair): with the tokenizer and settings
fixed by the folder, the text decides its token ids.

A file is one (run, rank, flush): written under a hidden temporary name, fsynced, renamed into
place, so two runs (two jobs on one cluster file system) never write the same file and a
reader never sees half of one. Each file's header names its key and the SHA-256 of its rows.
A file is read only when it can be trusted: a regular file (never a FIFO, a device or a link to
one; at most MAX_FILE_BYTES) owned by this user (the store may be a folder others can write:
their files are not read; the checksum catches accidents, not a writer), whole, of this key,
every logit finite. Any other is skipped (one warning line per run), never read as rows. A row
kept by two files (two runs evaluated it) is read from the newest (by modification time, then
name): ``--fresh-rows`` thus supersedes every older copy.

Provenance: a row a swarm computed records the servers whose answers its logits come from
(peer ids, in the file's header, under its checksum). A server the swarm audit blames
(:mod:`dist_eval.backends.audit`) is named in a ``<run>-r<rank>-<n>.blamed`` file of the key's
folder (written once, as the rows); a run serves no row of a server any such file names, in this
run or a later one (it is evaluated again), and writes none a server it blamed computed.

Exactness: a row from the store carries the logits of the run that evaluated it. Another
run's batches may hold that row with other rows or padding, which can change the last bits
of a float on some kernels; within one run everything is as exact as before, for any number
of ranks: rank 0 reads the store and tells every rank which rows it holds; the batch plan
leaves those out (the others in full batches, the same plan on every rank) and rank 0 reports
them. ``--fresh-rows`` evaluates every row again (and still stores them).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from typing import Dict, List, Optional, Tuple

import numpy as np

from dist_eval.atomic import atomic_write, cache_folder, read_regular
from dist_eval.backends.provenance import tokenizer_digest
from dist_eval.chunks import chunk_rows
from dist_eval.errors import warn
from dist_eval.results import mapped_array

MAGIC = b"DIST_EVAL_ROWS\x00"
FORMAT_VERSION = 1
SUFFIX = ".rows"
BLAMED_SUFFIX = ".blamed"  # a run's blamed servers: their rows are not served
KEY_BYTES = 16
# A row file's size bound (a reader never reads more): a flush of a rank's rows every save interval
# is far smaller (1M rows of 1000 classes, 4 GB, would be one flush of hours of a swarm's work)
MAX_FILE_BYTES = 4 << 30
# settings that decide which rows are evaluated, or how they are batched, not their logits
NOT_IN_KEY = ("label_column", "batch_size", "length_buckets", "max_batch_tokens", "limit", "limit_seed",
              "stop_at_width", "stop_when_decided", "stop_metric", "stop_round_rows", "stop_rule")


# The installed libraries whose version can change a row's tokens (tokenizers; sentencepiece: a slow
# tokenizer's pieces; transformers: its tokenizer classes) or logits (torch's kernels, transformers' and
# petals' model code, hivemind's wire, bitsandbytes' quantized and peft's adapted blocks on a local swarm)
KEYED_LIBRARIES = ("torch", "transformers", "tokenizers", "sentencepiece", "petals", "hivemind", "bitsandbytes",
                   "peft")


def library_versions() -> Dict[str, Optional[str]]:
    """{library: its installed version, None when it is not installed} of :data:`KEYED_LIBRARIES`."""
    from importlib import metadata

    versions = {}
    for name in KEYED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


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


def settings_facts(settings) -> dict:
    """The settings that change a row's tokens or logits (not which rows, nor their batches)."""
    return {name: value for name, value in settings.as_dict().items() if name not in NOT_IN_KEY}


def _text_bytes(value) -> bytes:
    """A cell's bytes, length first (so that text and pair cannot run into each other)."""
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else repr(value).encode()
    return len(data).to_bytes(8, "little") + data


def row_keys(texts: List, pairs: Optional[List]) -> np.ndarray:
    """[n, 16] uint8: each row's key, a BLAKE2b of its text and text pair (each length-prefixed)."""
    from dist_eval.data.sample import digest_each

    base = hashlib.blake2b(digest_size=KEY_BYTES, person=b"dist_eval-row")
    rows = (_text_bytes(text) + (b"\x00" if pairs is None else b"\x01" + _text_bytes(pairs[i]))
            for i, text in enumerate(texts))
    return np.frombuffer(digest_each(base, rows), dtype=np.uint8).reshape(len(texts), KEY_BYTES)


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
                parts.append(_read_columns(path, self.key, num_labels))
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
    keys, logits, seconds, which, sets = _read_columns(path, key, num_labels)
    return [bytes(row) for row in keys.view(f"V{KEY_BYTES}").ravel()], logits, seconds, [sets[i] for i in which]


def _read_columns(path: str, key: str, num_labels: Optional[int]) -> tuple:
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


class StoredRows:
    """The rows read from a store's files as columns (issue 51: about 24 bytes and the logits a row,
    not a dict entry of objects): the keys sorted (one copy of each: the newest), their logits,
    seconds and servers. A mapping {row key (bytes): (logits, seconds, servers)} as well.
    """

    def __init__(self, keys: np.ndarray, logits: np.ndarray, seconds: np.ndarray, which: np.ndarray, sets: list):
        self.keys, self.logits, self.seconds, self.which, self.sets = keys, logits, seconds, which, sets

    @classmethod
    def empty(cls, num_labels: int) -> StoredRows:
        return cls(np.zeros(0, f"V{KEY_BYTES}"), np.zeros((0, num_labels), "<f4"), np.zeros(0, "<f4"),
                   np.zeros(0, np.int32), [()])

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        return (bytes(key) for key in self.keys)

    def _position(self, key: bytes) -> int:
        at = int(np.searchsorted(self.keys, np.void(key)))
        if at == len(self.keys) or bytes(self.keys[at]) != key:
            raise KeyError(key)
        return at

    def __contains__(self, key) -> bool:
        try:
            self._position(key)
        except KeyError:
            return False
        return True

    def __getitem__(self, key: bytes) -> tuple:
        at = self._position(key)
        return self.logits[at], float(self.seconds[at]), self.sets[self.which[at]]

    def joined(self, newer: list) -> StoredRows:
        """These rows and ``newer`` files' columns (:func:`_read_columns`), oldest first: a row's newest copy kept."""
        sets = list(self.sets)
        which = [self.which]
        for _, _, _, part_which, part_sets in newer:
            which.append(np.asarray(part_which, np.int64) + len(sets))
            sets.extend(part_sets)
        keys = np.concatenate([self.keys, *(np.ascontiguousarray(part[0]).view(f"V{KEY_BYTES}").ravel()
                                            for part in newer)])
        order = np.argsort(keys, kind="stable")  # equal keys stay oldest first
        last = np.ones(len(order), dtype=bool)
        last[:-1] = keys[order[1:]] != keys[order[:-1]]
        kept = order[last]
        del order, last

        def column(mine, index):
            return np.concatenate([mine, *(part[index] for part in newer)])[kept]

        return StoredRows(keys[kept], column(self.logits, 1), column(self.seconds, 2),
                          np.concatenate(which)[kept].astype(np.int32), sets)

    def without_servers(self, blamed: set) -> StoredRows:
        """These rows but those a server of ``blamed`` computed."""
        bad = np.array([bool(blamed.intersection(servers)) for servers in self.sets])
        kept = ~bad[self.which]
        return StoredRows(self.keys[kept], self.logits[kept], self.seconds[kept], self.which[kept], self.sets)

    def find(self, keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(the rows of ``keys`` [n, 16] held here, ascending; each one's position here)."""
        wanted = np.ascontiguousarray(keys, dtype=np.uint8).view(f"V{KEY_BYTES}").ravel()
        if not len(self.keys):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        at = np.minimum(np.searchsorted(self.keys, wanted), len(self.keys) - 1)
        rows = np.flatnonzero(self.keys[at] == wanted)
        return rows, at[rows]


class RowValues:
    """{row of the set: one stored row's value} of :meth:`StoredRows.find`'s rows (a mapping by row,
    as :class:`dict`: ``in``, ``[]``, ``len``): the rows' positions in the columns, 4 bytes a row of the set.
    """

    def __init__(self, values: np.ndarray, slots: np.ndarray, count: int, as_float: bool = False):
        self.values, self.slots, self.count, self.as_float = values, slots, count, as_float

    @classmethod
    def of(cls, stored: StoredRows, rows: np.ndarray, positions: np.ndarray, num_rows: int) -> tuple:
        """(the logits by row, the seconds by row) of the ``rows`` held at ``positions``."""
        slots = np.full(num_rows, -1, dtype=np.int32 if len(stored) < 2**31 else np.int64)
        slots[rows] = positions
        return cls(stored.logits, slots, len(rows)), cls(stored.seconds, slots, len(rows), as_float=True)

    def __len__(self) -> int:
        return self.count

    def __contains__(self, row) -> bool:
        return 0 <= row < len(self.slots) and self.slots[row] >= 0

    def __getitem__(self, row):
        if row not in self:
            raise KeyError(row)
        value = self.values[self.slots[row]]
        return float(value) if self.as_float else value


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
        ``taken`` (:class:`~dist_eval.backends.audit.Taken`): the swarm servers they come from.
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
