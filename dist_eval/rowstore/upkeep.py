"""A row store's upkeep: ``python -m dist_eval.rowstore verify|compact DIR``.

``verify`` reads every row file under DIR as a run would (:func:`~dist_eval.rowstore.read_file`'s
rules: a regular file this user owns, whole, of its folder's key, every logit finite) and reports,
for each key folder, the files a run trusts, their rows and the copies a newer copy supersedes,
and every file a run skips, with why. Exit status 1 when any file is skipped, else 0.

``compact`` writes each key folder's rows, the newest copy of each (the copy a run reads), into
one file (a few above :data:`~dist_eval.rowstore.MAX_FILE_BYTES`) dated as the newest file it
replaces (each row with the servers that computed it; rows of a server a ``.blamed`` file names,
which no run serves, left out), then removes the files it replaced and the untrusted files this
user owns (a cut or corrupted file, non-finite logits, another key's, a FIFO or a link). Another user's files are
left where they are and named: not this user's to remove, and never read. It reports what it
dropped. A run that reads the folder meanwhile at worst evaluates some rows again; a file a run
writes meanwhile is neither read nor removed.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from dist_eval.rowstore.files import MAX_FILE_BYTES, SUFFIX, blamed_servers, read_rows, row_files, write_file
from dist_eval.rowstore.keys import KEY_BYTES

# room left in a compacted file for its magic, header and JSON
_HEADER_ROOM = 4096


@dataclass
class FolderSurvey:
    """One key folder as a run reads it: the rows it serves (the newest copy of each), the files
    they come from, the older copies, and the files it skips with why.
    """

    folder: str
    key: str
    rows: Dict[bytes, Tuple[np.ndarray, float, tuple]] = field(default_factory=dict)  # logits, seconds, servers
    trusted: List[str] = field(default_factory=list)
    newest_ns: int = 0  # the newest trusted file's modification time
    superseded: int = 0  # copies of a row that a newer file's copy replaces
    skipped: List[Tuple[str, str]] = field(default_factory=list)  # (path, why)
    blamed: int = 0  # rows of a server a .blamed file names: never served, dropped by compact


def key_folders(root: str) -> List[Tuple[str, str]]:
    """(folder, key) of every folder under ``root`` (``root`` included) holding row files; the
    key is the folder's last two names (``<model key>/<task key>``), as the store lays it out.
    """
    found = []
    for folder, _, names in os.walk(root):
        if any(n.endswith(SUFFIX) and not n.startswith(".") for n in names):
            path = os.path.abspath(folder)
            found.append((folder, f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}"))
    return sorted(found)


def survey(folder: str, key: str) -> FolderSurvey:
    """Read ``folder`` as a run of ``key`` does: oldest file first, a later copy of a row wins."""
    seen = FolderSurvey(folder, key)
    num_labels: Optional[int] = None
    for path in row_files(folder):
        try:
            keys, logits, seconds, servers = read_rows(path, key, num_labels)
        except (OSError, ValueError) as e:
            seen.skipped.append((path, str(e)))
            continue
        num_labels = logits.shape[1]  # the first whole file's: every file of a key has as many
        seen.trusted.append(path)
        seen.newest_ns = max(seen.newest_ns, os.lstat(path).st_mtime_ns)
        for i, row in enumerate(keys):
            seen.superseded += row in seen.rows
            seen.rows[row] = (logits[i], float(seconds[i]), servers[i])
    blamed = blamed_servers(folder)
    if blamed:
        kept = {row: hit for row, hit in seen.rows.items() if not blamed.intersection(hit[2])}
        seen.blamed, seen.rows = len(seen.rows) - len(kept), kept
    return seen


def compact(seen: FolderSurvey) -> Tuple[List[str], List[str], List[Tuple[str, str]]]:
    """Replace ``seen``'s trusted files by one of their rows (or a few), dated as the newest it
    replaces, then remove them and the untrusted files this user owns. Returns (files written,
    files removed, (file, why) of those left: another user's, or not removable).
    """
    written = _write_compacted(seen) if len(seen.trusted) > 1 or seen.superseded or seen.blamed else []
    replaced = seen.trusted if written or (seen.blamed and not seen.rows) else []
    removed, left = [], []
    for path in [*replaced, *(p for p, _ in seen.skipped)]:
        try:
            if os.lstat(path).st_uid != os.geteuid():
                left.append((path, "another user's: never read by this user's runs, not theirs to remove"))
                continue
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError as e:
            left.append((path, f"not removed: {e}"))
    return written, removed, left


def _write_compacted(seen: FolderSurvey) -> List[str]:
    """The survey's rows in files of at most MAX_FILE_BYTES, named as no run names its files."""
    if not seen.rows:
        return []
    keys = np.frombuffer(b"".join(seen.rows), dtype=np.uint8).reshape(-1, KEY_BYTES)
    logits = np.stack([v[0] for v in seen.rows.values()]).astype("<f4")
    seconds = np.array([v[1] for v in seen.rows.values()], dtype="<f4")
    servers = [v[2] for v in seen.rows.values()]
    per_file = max(1, (MAX_FILE_BYTES - _HEADER_ROOM) // (KEY_BYTES + 4 * logits.shape[1] + 4))
    prefix = f"{uuid.uuid4().hex[:12]}-{os.getpid()}-compacted"
    written = []
    for n, start in enumerate(range(0, len(keys), per_file)):
        path = os.path.join(seen.folder, f"{prefix}-{n:06d}{SUFFIX}")
        end = start + per_file
        write_file(path, seen.key, keys[start:end], logits[start:end], seconds[start:end], servers[start:end])
        # as old as the newest file it replaces: a file a run writes meanwhile stays newer
        os.utime(path, ns=(seen.newest_ns, seen.newest_ns))
        written.append(path)
    return written


def _name(path: str, root: str) -> str:
    return os.path.relpath(path, root)


def _say_survey(seen: FolderSurvey, root: str) -> None:
    print(f"{seen.key}: {len(seen.trusted)} file(s) trusted, {len(seen.rows)} row(s), "
          f"{seen.superseded} older cop(ies) superseded; {len(seen.skipped)} file(s) skipped"
          + (f"; {seen.blamed} row(s) of blamed servers withheld" if seen.blamed else ""))
    for path, why in seen.skipped:
        print(f"  skipped {_name(path, root)}: {why}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dist_eval.rowstore",
        description="Verify or compact a row store (--row-store DIR, or the default $DIST_EVAL_CACHE/rows).")
    parser.add_argument("action", choices=("verify", "compact"),
                        help="verify: report what a run would read and skip; compact: one file per key, "
                             "superseded copies and untrusted files this user owns removed")
    parser.add_argument("dir", metavar="DIR", help="the store's folder, or one key's folder in it")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"dist_eval.rowstore: DIR {args.dir!r} is not a folder; pass the row store's folder "
              "(--row-store DIR; by default ~/.cache/dist_eval/rows).", file=sys.stderr)
        return 2
    folders = key_folders(args.dir)
    if not folders:
        print(f"{args.dir}: no row files")
        return 0
    skipped = 0
    for folder, key in folders:
        seen = survey(folder, key)
        skipped += len(seen.skipped)
        _say_survey(seen, args.dir)
        if args.action == "compact":
            written, removed, left = compact(seen)
            print(f"  compacted: {len(written)} file(s) written, {len(removed)} removed "
                  f"({seen.superseded} superseded cop(ies) and {len(seen.skipped) - len(left)} untrusted "
                  f"file(s) dropped); {len(left)} file(s) left")
            for path, why in left:
                print(f"  left {_name(path, args.dir)}: {why}")
    return 1 if skipped and args.action == "verify" else 0
