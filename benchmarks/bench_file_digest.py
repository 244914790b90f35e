"""What identifying a big weight file costs (issue 50): its whole SHA-256 at a model's first start,
then the digest cache's lookup at every later start.

    .venv/bin/python benchmarks/bench_file_digest.py [--mib 256] [--repeat 3]

Writes a file of random bytes (in the page cache: the figures are the hash's, not a disk's),
then times ``dist_eval.backends.provenance.file_digest`` on it with an empty digest cache
(hashed whole and kept) and again (read from the cache), in a cache folder of its own.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _write_random(path: str, mib: int) -> None:
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the file's size in MiB (over 64: cached)")
    parser.add_argument("--repeat", type=int, default=3, help="each measure this many times (the best kept)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        os.environ["DIST_EVAL_CACHE"] = os.path.join(folder, "cache")
        from dist_eval.backends.provenance import DIGEST_CACHE, file_digest

        path = os.path.join(folder, "model.safetensors")
        _write_random(path, args.mib)
        first, cached = [], []
        for _ in range(args.repeat):
            cache = os.path.join(folder, "cache", DIGEST_CACHE)
            if os.path.exists(cache):
                os.unlink(cache)
            first.append(_timed(lambda: file_digest(path)))
            cached.append(_timed(lambda: file_digest(path)))
        size_mb = args.mib * (1 << 20) / 1e6
        print(f"{args.mib} MiB ({size_mb:.0f} MB), best of {args.repeat}:")
        print(f"  first start (hashed whole, kept in the cache): {min(first):.3f} s, {size_mb / min(first):.0f} MB/s")
        print(f"  a later start (read from the cache): {min(cached) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
