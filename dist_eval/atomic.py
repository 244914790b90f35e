"""Files: atomic writes (a reader sees the whole file or none), and a file's digest."""
from __future__ import annotations

import hashlib
import os
from typing import IO, Callable, Union


def atomic_write(path: str, content: Union[str, bytes, Callable[[IO], None]], *, binary: bool = False) -> str:
    """Write ``content`` (text, bytes, or a function given the open file) to ``path``.

    The file is written under a temporary name in the same folder (the pid in it: a
    restarted process never collides with a dead one's leftovers), then renamed into
    place. No fsync: the rename alone is atomic for readers, which is what a killed
    process needs; a machine crash may lose the last write.
    """
    binary = binary or isinstance(content, bytes)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb" if binary else "w") as f:
        if callable(content):
            content(f)
        else:
            f.write(content)
    os.replace(tmp, path)
    return path


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (hex), read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
