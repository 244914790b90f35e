"""Files: atomic writes (a reader sees the whole file or none), bounded reads of regular files only,
and a file's digest.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
from typing import IO, Callable, Optional, Union

# opened without following a planted link, and closed in any process the writer starts
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


Content = Union[str, bytes, Callable[[IO], None]]


def atomic_write(path: str, content: Content, *, binary: bool = False) -> str:
    """Write ``content`` (text in UTF-8, bytes, or a function given the open file) to ``path``.

    The file is written under a new hidden temporary name in the same folder, created
    exclusively (a link or file planted under any name is never followed nor overwritten) and
    readable by this user only until it is whole; fsynced, given the mode a plain ``open``
    would give it (0666 less the umask), renamed into place, then the folder fsynced: a reader
    sees the whole file or none, also after a machine crash. A write that fails removes its
    temporary file.
    """
    return _published(path, content, binary, os.replace)


def atomic_create(path: str, content: Content, *, binary: bool = False) -> str:
    """:func:`atomic_write`, but only where ``path`` does not exist: FileExistsError otherwise (a lock
    taken: its content whole or absent to every reader, never a file half written). The whole
    temporary file is linked to ``path`` (a link fails where the name exists); on a file system
    without links, ``path`` is created exclusively and written in place.
    """
    def link(tmp: str, final: str) -> None:
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise
        except OSError:  # no hard links here (some FUSE or FAT file systems)
            with os.fdopen(os.open(final, _CREATE, 0o666 & ~umask()), "wb") as f, open(tmp, "rb") as whole:
                f.write(whole.read())
        os.unlink(tmp)

    return _published(path, content, binary, link)


def _published(path: str, content: Content, binary: bool, publish: Callable[[str, str], None]) -> str:
    """``content`` written whole to a new temporary file beside ``path``, then ``publish(tmp, path)``."""
    binary = binary or isinstance(content, bytes)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = scratch_beside(path, "tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_folder(folder)
    return path


def scratch_beside(path: str, kind: str) -> tuple:
    """(a file descriptor open for reading and writing, its name): a new hidden file beside ``path``
    (``.NAME.KIND<pid>-<random>``), created exclusively (nothing planted under any name is followed) and readable
    by this user only. The caller removes it.
    """
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{kind}{os.getpid()}-{secrets.token_hex(4)}")
    return os.open(tmp, (_CREATE & ~os.O_WRONLY) | os.O_RDWR, 0o600), tmp


def umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (best effort: some file systems refuse a folder's fsync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_regular(path: str, max_bytes: int, *, owner: Optional[int] = None) -> bytes:
    """The bytes of ``path`` when it is a regular file (or a link to one) of at most ``max_bytes``,
    owned by the user id ``owner`` when given; else ValueError saying what it is. Never blocks (a
    FIFO opens at once, non-blocking, and is refused) and never reads past the bound (a link to
    ``/dev/zero`` is a device: refused).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if owner is not None and info.st_uid != owner:
            raise ValueError(f"owned by another user (uid {info.st_uid})")
        if info.st_size > max_bytes:
            raise ValueError(f"{info.st_size} bytes, over the bound of {max_bytes}")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 24, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise ValueError(f"grew past the bound of {max_bytes} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


# A cell that starts with one of these is a formula to a spreadsheet (OWASP: CSV injection)
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def csv_cell(value):
    """A cell of a CSV file dist_eval writes: a text a spreadsheet would run as a formula (it starts
    with ``= + - @``, a tab or a carriage return) gets a leading single quote, as OWASP advises; a
    number (``-1.5``, a negative number too) and anything not a text are left as they are.
    """
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS) and not _NUMBER.fullmatch(value):
        return "'" + value
    return value


def cache_folder() -> str:
    """dist_eval's cache folder: ``$DIST_EVAL_CACHE`` if set, else ``~/.cache/dist_eval``."""
    return os.environ.get("DIST_EVAL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dist_eval")


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (hex), read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
