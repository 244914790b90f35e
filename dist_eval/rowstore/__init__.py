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
(:mod:`dist_eval.backends.petals.audit`) is named in a ``<run>-r<rank>-<n>.blamed`` file of the key's
folder (written once, as the rows); a run serves no row of a server any such file names, in this
run or a later one (it is evaluated again), and writes none a server it blamed computed.

Exactness: a row from the store carries the logits of the run that evaluated it. Another
run's batches may hold that row with other rows or padding, which can change the last bits
of a float on some kernels; within one run everything is as exact as before, for any number
of ranks: rank 0 reads the store and tells every rank which rows it holds; the batch plan
leaves those out (the others in full batches, the same plan on every rank) and rank 0 reports
them. ``--fresh-rows`` evaluates every row again (and still stores them).

The package's modules, in data-flow order: :mod:`~dist_eval.rowstore.keys` (what the keys are made of),
:mod:`~dist_eval.rowstore.files` (the files on disk), :mod:`~dist_eval.rowstore.rows` (stored rows in
memory), :mod:`~dist_eval.rowstore.store` (one key's folder), :mod:`~dist_eval.rowstore.source` (a run's
use of it), :mod:`~dist_eval.rowstore.upkeep` (``python -m dist_eval.rowstore verify|compact``).
"""
from dist_eval.backends.provenance import tokenizer_digest
from dist_eval.rowstore.files import (
    BLAMED_SUFFIX,
    FORMAT_VERSION,
    MAGIC,
    MAX_FILE_BYTES,
    SUFFIX,
    blamed_servers,
    read_file,
    read_rows,
    row_files,
    write_file,
)
from dist_eval.rowstore.keys import KEY_BYTES, KEYED_LIBRARIES, NOT_IN_KEY, library_versions, row_keys, settings_facts
from dist_eval.rowstore.rows import RowValues, StoredRows
from dist_eval.rowstore.source import RowSource, open_rows, run_store, store_for
from dist_eval.rowstore.store import RowStore, RowWriter, store_root

__all__ = ["BLAMED_SUFFIX", "FORMAT_VERSION", "KEYED_LIBRARIES", "KEY_BYTES", "MAGIC", "MAX_FILE_BYTES", "NOT_IN_KEY",
           "SUFFIX", "RowSource", "RowStore", "RowValues", "RowWriter", "StoredRows", "blamed_servers",
           "library_versions", "open_rows", "read_file", "read_rows", "row_files", "row_keys", "run_store",
           "settings_facts", "store_for", "store_root", "tokenizer_digest", "write_file"]
