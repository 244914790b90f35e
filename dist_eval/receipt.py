"""A report's receipt (issue 73): ``metrics.json``'s ``run.receipt``, one object written once, that binds
the report's numbers to what made them: the content of the model's files the run read (and, on a swarm,
what each server announced), the checkpoint, the data files and the rows (an order-free digest of each
row's content key and label), every setting that changes a number, dist_eval's version (and commit in a
checkout), the numeric environment, the swarm audit's summary, and the digests of ``predictions.jsonl``
(the file as written on disk, closed) and of the metrics. ``python -m dist_eval.verify OUT``
(:mod:`dist_eval.verify`) checks a report against it.

Signed with ``--sign KEY`` (an Ed25519 key, through the ``cryptography`` package hivemind installs): the
public key is in the receipt, and a verifier who knows it (``verify --key``) knows the receipt is the key
holder's, unchanged. Unsigned, a receipt says what made the numbers and lets anyone check them against the
files and a model of their own, but not who wrote it (anyone who edits a report can write a receipt that
matches the edit: what catches that is checking the numbers, which ``verify`` does).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from dist_eval.plan import Pair
    from dist_eval.run_context import RunContext

FORMAT = 1
# The tolerance of a verifier whose numerics differ from the run's (tests/float_promises.py's ROUNDING):
# |verifier - report| <= RELATIVE_TOLERANCE * (1 + |report|), for each logit
RELATIVE_TOLERANCE = 1e-5
# The options (besides dist_eval.config.Settings) that change a number of the report
NUMBER_OPTIONS = ("bootstrap_resamples", "bootstrap_seed", "top_k", "slice_by", "cluster_by", "shard")


def canonical_json(value) -> bytes:
    """``value`` as JSON read back from its file: sorted keys, no spaces (the digest of the metrics is of
    this, so it is the same from the report in memory and from metrics.json).
    """
    return json.dumps(json.loads(json.dumps(value, default=jsonable)), sort_keys=True,
                      separators=(",", ":")).encode()


def jsonable(value):
    """The scalars and arrays of numpy as metrics.json writes them (:func:`dist_eval.output.files.write_metrics`)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def metrics_digest(metrics: dict) -> str:
    """SHA-256 of every key of the report but ``run`` (the facts of the run, which hold the receipt and the
    timings written at the shutdown): the metrics, intervals, slices, per-class tables.
    """
    return hashlib.sha256(canonical_json({k: v for k, v in metrics.items() if k != "run"})).hexdigest()


def rows_digest(keys: np.ndarray, labels: np.ndarray) -> str:
    """An order-free SHA-256 of the rows: each row's content key (uint64) and label (class id), sorted."""
    keys = np.asarray(keys, dtype=np.uint64)
    labels = np.asarray(labels, dtype=np.int64)
    order = np.lexsort((labels, keys))
    digest = hashlib.sha256(b"dist_eval-rows-v1:%d:" % len(keys))
    digest.update(keys[order].astype("<u8").tobytes())
    digest.update(labels[order].astype("<i8").tobytes())
    return digest.hexdigest()


def hex_keys(texts: Sequence[str]) -> np.ndarray:
    """predictions.jsonl's ``key`` texts (16 hex digits) as uint64."""
    return np.array([int(text, 16) for text in texts], dtype=np.uint64)


def data_identity(path: str, dataset=None) -> dict:
    """A data file's content (its SHA-256), a folder's (each file's), or a hub dataset's name and
    ``datasets`` fingerprint (``dataset``: the loaded one).
    """
    from dist_eval.backends.provenance import file_digest, folder_identity

    if os.path.isfile(path):
        return {"path": os.path.abspath(path), "sha256": file_digest(path)}
    if os.path.isdir(path):
        return {"path": os.path.abspath(path), "files": dict(folder_identity(path)["files"])}
    return {"hub": path, "fingerprint": getattr(dataset, "_fingerprint", None)}


def code_facts() -> dict:
    """dist_eval's version, with its code's digest (:func:`~dist_eval.backends.provenance.dist_eval_version`), and,
    in a git checkout, its commit (read from .git, no git process).
    """
    from dist_eval.backends.provenance import dist_eval_version

    return {"dist_eval": dist_eval_version(), "commit": _checkout_commit(os.path.dirname(os.path.dirname(__file__)))}


def _checkout_commit(root: str) -> Optional[str]:
    git = os.path.join(root, ".git")
    try:
        if os.path.isfile(git):  # a worktree: "gitdir: PATH"
            with open(git) as f:
                git = os.path.join(root, f.read().split(":", 1)[1].strip())
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        for base in (git, _common_dir(git)):
            path = os.path.join(base, ref)
            if os.path.isfile(path):
                with open(path) as f:
                    return f.read().strip()
            packed = os.path.join(base, "packed-refs")
            if os.path.isfile(packed):
                with open(packed) as f:
                    for line in f:
                        if line.rstrip().endswith(" " + ref):
                            return line.split()[0]
    except (OSError, IndexError):
        return None
    return None


def _common_dir(git: str) -> str:
    try:
        with open(os.path.join(git, "commondir")) as f:
            return os.path.normpath(os.path.join(git, f.read().strip()))
    except OSError:
        return git


def numerics(device: Optional[str] = None) -> dict:
    """What decides the last bits of a logit computed here: torch's and transformers' versions, the
    device kind (a GPU's name), torch's CPU instruction set and its threads.
    """
    import torch
    import transformers

    kind = str(device or "cpu").split(":")[0]
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "device": kind,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
           "dtype": "float32"}
    if kind == "cuda" and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def server_numerics(swarm: Optional[dict]) -> Optional[list]:
    """Each distinct (petals version, dtype, quantization) the swarm's servers announced, or None."""
    if not swarm:
        return None
    kinds = {(s.get("petals_version"), s.get("torch_dtype"), s.get("quantization")) for s in swarm.get("servers", [])}
    return [{"petals_version": v, "torch_dtype": d, "quantization": q} for v, d, q in sorted(kinds, key=str)]


def audit_summary(swarm: Optional[dict]) -> Optional[dict]:
    """The swarm audit's summary (``run.swarm.audit``'s totals), or None where none ran."""
    audit = (swarm or {}).get("audit")
    if not audit:
        return None
    keys = ("share", "requests", "request_rows", "replayed", "replayed_rows", "row_checks", "row_checked_rows",
            "max_difference", "max_tolerance")
    return {**{k: audit.get(k) for k in keys}, "excluded": sorted(audit.get("excluded") or {}),
            "mismatches": sum(int(s.get("mismatches") or 0) for s in (audit.get("servers") or {}).values())}


def promise(metrics: dict) -> dict:
    """What a verifier may expect of a row's logits evaluated again: bit for bit where its numerics are the
    run's and every row was computed in this run's batch plan (none served by the row store, no rounds of a
    run that stopped early), else within :data:`RELATIVE_TOLERANCE`.
    """
    run = metrics.get("run") or {}
    from_store = int(((run.get("row_store") or {}).get("rows_from_store")) or 0)
    exact = not from_store and not metrics.get("stopping")
    why = None if exact else ("rows served by the row store were computed in other batches" if from_store
                              else "a run in rounds plans each round alone")
    return {"same_numerics": "bit for bit" if exact else "within tolerance", "why": why,
            "other_numerics": "within tolerance",
            "tolerance": {"relative": RELATIVE_TOLERANCE, "rule": "|verifier - report| <= relative * (1 + |report|)"}}


def build(context: RunContext, pair: Pair, result, rows, predictions_path: str) -> dict:
    """Rank 0, once the predictions are written: the pair's receipt (``metrics`` complete but for it)."""
    from dist_eval.backends.checkpoint import checkpoint_digest
    from dist_eval.backends.provenance import file_digest

    config, job, model = context.config, context.job, context.model
    metrics, merged = result.metrics, result.predictions
    run = metrics.get("run") or {}
    identity = getattr(model, "identity", None) or {}
    folder = (identity.get("model") or {}).get("folder") or {}
    checkpoint = pair.checkpoint.path
    head = job.head
    keys = np.asarray(rows.keys.keys, dtype=np.uint64)[np.asarray(merged.indices, dtype=np.int64)]
    settings = {**job.settings.as_dict(), **{name: getattr(config.options, name, None) for name in NUMBER_OPTIONS},
                "split": job.split, "tuning_mode": config.tuning_mode, "pre_seq_len": config.pre_seq_len,
                "num_labels": config.num_labels, "label_names": metrics.get("label_names")}
    return signed({
        "format": FORMAT,
        "backend": config.backend,
        "model": {"path": os.path.abspath(job.model_dir), "files": files_read(folder, getattr(model, "source", None)),
                  "hub_commit": folder.get("hub_commit")},
        "servers": (run.get("swarm") or {}).get("servers"),
        "checkpoint": None if not checkpoint else {
            "path": os.path.abspath(checkpoint) if os.path.exists(checkpoint) else checkpoint,
            "sha256": checkpoint_digest(checkpoint), "tensors": identity.get("trainable")},
        "head": None if not head else {"path": os.path.abspath(head),
                                       "sha256": file_digest(head) if os.path.isfile(head) else None},
        "data": {"files": [data_identity(path, rows.dataset) for path in pair.data.files], "split": job.split,
                 "rows": int(len(merged.indices)), "rows_in_data": int(rows.rows_in_data),
                 "rows_digest": rows_digest(keys, merged.labels)},
        "settings": settings,
        "code": code_facts(),
        "numerics": {**numerics(config.device if config.backend == "local" else "cpu"),
                     "servers": server_numerics(run.get("swarm"))},
        "audit": audit_summary(run.get("swarm")),
        "promise": promise(metrics),
        "predictions_sha256": predictions_digest(predictions_path),
        "metrics_sha256": metrics_digest(metrics),
    }, getattr(config, "sign", None))


def files_read(folder: dict, source) -> dict:
    """{name: digest} of the model folder's files: as the load found them (``folder``, the model's identity), and
    those that came since (``source``: how the model was loaded): a hub id's blocks streamed are fetched when the
    forward first reaches each, after the load, and the run read them too.
    """
    from dist_eval.backends.provenance import folder_identity

    files = dict(folder.get("files") or [])
    model_dir = getattr(source, "model_dir", None)
    if model_dir and os.path.isdir(model_dir):
        files.update(folder_identity(model_dir)["files"])  # hashed again only where the files changed
    return files


def predictions_digest(path: str) -> str:
    """SHA-256 of predictions.jsonl as written on disk, read once it is closed: the one place it is taken."""
    from dist_eval.atomic import file_sha256

    return file_sha256(path)


def merged(shard_receipts: Sequence[Optional[dict]], metrics: dict, merged_rows, keys: Sequence[str],
           predictions_path: str) -> Optional[dict]:
    """The receipt of a merge of shards (:mod:`dist_eval.shard_merge`): the first shard's model, checkpoint,
    data files, settings (no ``shard``) and code; the merged rows' digest, predictions and metrics; each shard's
    ``numerics``, ``audit`` and its own predictions' digest under ``shards``. Bit for bit is promised only where
    every shard's numerics and promise were the same. None where a shard has no receipt (an earlier version's).
    """
    if not shard_receipts or any(not isinstance(r, dict) for r in shard_receipts):
        return None
    first = shard_receipts[0]
    numerics_of = [json.dumps(r.get("numerics"), sort_keys=True) for r in shard_receipts]
    promise_ = dict(first.get("promise") or {})
    if len(set(numerics_of)) > 1 or any((r.get("promise") or {}).get("same_numerics") != "bit for bit"
                                        for r in shard_receipts):
        promise_.update(same_numerics="within tolerance", why="the shards were computed with other numerics, or "
                        "one of them promised no more")
    indices = np.asarray(merged_rows.indices, dtype=np.int64)
    first = {k: v for k, v in first.items() if k != "signature"}  # a shard's: it would not verify the merge's
    return {
        **first,
        "settings": {**(first.get("settings") or {}), "shard": None},
        "data": {**(first.get("data") or {}), "rows": int(len(indices)),
                 "rows_digest": rows_digest(hex_keys([keys[i] for i in indices.tolist()]), merged_rows.labels)},
        "audit": None,
        "promise": promise_,
        "shards": [{"shard": (r.get("settings") or {}).get("shard"), "numerics": r.get("numerics"),
                    "audit": r.get("audit"), "predictions_sha256": r.get("predictions_sha256")}
                   for r in shard_receipts],
        "predictions_sha256": predictions_digest(predictions_path),
        "metrics_sha256": metrics_digest(metrics),
    }


# ------------------------------------------------------------------------------- signing (--sign KEY)

def _private_key(path: str):
    """The Ed25519 private key of a PEM file; a UsageError naming --sign otherwise."""
    from dist_eval.errors import UsageError

    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key
    except ImportError as e:  # installed with hivemind
        raise UsageError("signing needs the cryptography package, not installed here. pip install cryptography, "
                         "or drop --sign.", param="sign", value=path) from e
    try:
        with open(path, "rb") as f:
            key = load_pem_private_key(f.read(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"expected an unencrypted PEM Ed25519 private key, could not read one ({type(e).__name__}: "
                         f"{e}). Make one with: openssl genpkey -algorithm ed25519 -out key.pem",
                         param="sign", value=path) from e
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"expected an Ed25519 private key, got a {type(key).__name__}. Make one with: openssl "
                         "genpkey -algorithm ed25519 -out key.pem", param="sign", value=path)
    return key


def check_signing_key(path: Optional[str]) -> None:
    """--sign KEY readable as an Ed25519 private key, before any work."""
    if path is not None:
        _private_key(path)


def signed(receipt: dict, key_path: Optional[str]) -> dict:
    """``receipt`` with ``signature``: the Ed25519 signature of its canonical JSON (without the signature), the
    public key (raw, hex) beside it. Unchanged without a key.
    """
    if key_path is None:
        return receipt
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = _private_key(key_path)
    body = canonical_json({k: v for k, v in receipt.items() if k != "signature"})
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    return {**receipt, "signature": {"algorithm": "ed25519", "public_key": public, "value": key.sign(body).hex()}}


def signature_valid(receipt: dict) -> Optional[bool]:
    """Whether the receipt's signature verifies with its public key (None: not signed)."""
    signature = receipt.get("signature")
    if not isinstance(signature, dict):
        return None
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(signature["public_key"]))
        key.verify(bytes.fromhex(signature["value"]), canonical_json({k: v for k, v in receipt.items()
                                                                      if k != "signature"}))
    except (InvalidSignature, ValueError, KeyError, TypeError):
        return False
    return True
