"""Check a finished report against its receipt and its own rows: ``python -m dist_eval.verify OUT``
(or ``dist-eval verify OUT``).

1. The report's own files: ``predictions.jsonl`` and the metrics against the receipt's digests
   (``metrics.json``'s ``run.receipt``: :mod:`dist_eval.receipt`); every metric and interval recomputed
   from ``predictions.jsonl`` (:mod:`dist_eval.rescore`'s computation) and compared with the report; the
   rows' order-free digest (content keys and labels) against the receipt's.
2. Every digest it can reach: the model's files, the checkpoint, the data files (where the receipt says
   they were, or where ``--model``, ``--checkpoint``, ``--data-files`` say they are now).
3. With ``--backend local`` (its blocks streamed from disk one at a time: :mod:`dist_eval.backends.streamed`;
   ``--in-memory`` loads the model whole) (or ``--backend petals --initial-peers ...``: another swarm): a share of the
   rows, drawn with a seed the verifier draws (``--share``, default 2%, at least ``--min-rows``, or every
   row when fewer), evaluated again in the batches of the run's own plan, and each row's logits (the loss
   and prediction where the report has no logits) compared: bit for bit where the numerics are the run's,
   else within the receipt's tolerance.

One line per finding, then a verdict line with the chance that a report wrong on 1% of its rows would have
passed the rows evaluated again. Exit 0 only when everything checked agrees; 1 when something differs; 2
when OUT is not a report with a receipt, or a flag is wrong.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
from typing import List, Optional, Sequence

import numpy as np

from dist_eval.errors import UsageError

PROG = "dist_eval.verify"
EXIT_DIFFERS, EXIT_USAGE = 1, 2
DEFAULT_SHARE = 0.02
DEFAULT_MIN_ROWS = 300
SHOWN_ROWS = 10  # rows that differ named one a line; the rest counted


class Findings:
    """What differs (each a line), and what was checked or could not be."""

    def __init__(self, say=print):
        self.differs: List[str] = []
        self.checked: List[str] = []
        self.unchecked: List[str] = []
        self.say = say

    def differ(self, line: str) -> None:
        self.differs.append(line)
        self.say(f"{PROG}: DIFFERS: {line}", flush=True)

    def ok(self, line: str) -> None:
        self.checked.append(line)
        self.say(f"{PROG}: ok: {line}", flush=True)

    def skip(self, line: str) -> None:
        self.unchecked.append(line)
        self.say(f"{PROG}: not checked: {line}", flush=True)


def _read(folder: str):
    paths = {name: os.path.join(folder, name) for name in ("metrics.json", "predictions.jsonl")}
    missing = [name for name, path in paths.items() if not os.path.isfile(path)]
    if missing:
        raise UsageError(f"{folder}: missing {' and '.join(missing)}. Pass the --output-dir of a finished run.")
    try:
        with open(paths["metrics.json"]) as f:
            metrics = json.load(f)
    except ValueError as e:
        raise UsageError(f"{folder}/metrics.json: not JSON ({e}). Pass the --output-dir of a finished run.") from e
    receipt = (metrics.get("run") or {}).get("receipt") if isinstance(metrics, dict) else None
    if not isinstance(receipt, dict):
        raise UsageError(f"{folder}/metrics.json: expected a receipt (run.receipt), found none: a report written "
                         "before dist_eval wrote receipts, or a partial merge of shards. Run the evaluation again with "
                         "this version, then verify its --output-dir.")
    rows = []
    with open(paths["predictions.jsonl"], "rb") as f:  # bytes: a line that is not UTF-8 is one unreadable line
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:  # UnicodeDecodeError too
                    row = None
                rows.append(row if isinstance(row, dict) else {"unreadable_line": number})
    return metrics, receipt, rows, paths


def _public_key_hex(key: str) -> str:
    """--key: a PEM public key file, or the 64 hex digits of a raw Ed25519 public key."""
    if os.path.isfile(key):
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

        try:
            with open(key, "rb") as f:
                return load_pem_public_key(f.read()).public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        except (ValueError, TypeError, OSError) as e:
            raise UsageError(f"expected a PEM Ed25519 public key, could not read one ({e}). Pass the signer's "
                             "public key (openssl pkey -in key.pem -pubout) or its 64 hex digits.", param="key",
                             value=key) from e
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key.lower()):
        raise UsageError("expected a PEM public key file or 64 hex digits (a raw Ed25519 public key). Pass the "
                         "signer's public key.", param="key", value=key)
    return key.lower()


def _check_signature(receipt: dict, key: Optional[str], findings: Findings) -> None:
    from dist_eval.receipt import signature_valid

    valid = signature_valid(receipt)
    public = (receipt.get("signature") or {}).get("public_key") if valid is not None else None
    if valid is None:
        if key is not None:
            findings.differ(f"--key: the receipt is not signed, the key {key[:16]}... was expected to have signed it")
        else:
            findings.skip("the receipt's signature (not signed: --sign KEY at the run)")
    elif not valid:
        findings.differ("the receipt's signature does not verify with its public key: the receipt was changed after "
                        "it was signed")
    elif key is not None and key != public:
        findings.differ(f"--key: the receipt is signed by the key {public[:16]}..., not the expected {key[:16]}...")
    else:
        findings.ok(f"the receipt is signed by the key {public[:16]}...{' (--key)' if key else ''}, unchanged since")


def check_report(folder: str, findings: Findings, key: Optional[str] = None) -> tuple:
    """Step 1: the report's files against the receipt, the metrics recomputed, the rows' digest."""
    from dist_eval.receipt import hex_keys, metrics_digest, predictions_digest, rows_digest
    from dist_eval.rescore import differences, not_rescored, rescore

    metrics, receipt, rows, paths = _read(folder)
    _check_signature(receipt, key, findings)
    got = predictions_digest(paths["predictions.jsonl"])
    if got != receipt.get("predictions_sha256"):
        findings.differ(f"predictions.jsonl: sha256 {got[:16]}..., the receipt says "
                        f"{str(receipt.get('predictions_sha256'))[:16]}...: the file was changed after the run")
    else:
        findings.ok("predictions.jsonl is the file the run wrote (sha256)")
    got = metrics_digest(metrics)
    if got != receipt.get("metrics_sha256"):
        findings.differ(f"metrics.json: the metrics' sha256 {got[:16]}..., the receipt says "
                        f"{str(receipt.get('metrics_sha256'))[:16]}...: a metric was changed after the run")
    else:
        findings.ok("metrics.json's metrics are those the run wrote (sha256)")
    try:
        rescored = rescore(folder)
    except UsageError as e:
        findings.differ(f"predictions.jsonl cannot be rescored: {e}")
        rescored = None
    if rescored is not None:
        differ = differences(metrics, rescored)
        for key in differ:
            findings.differ(f"{key}: recomputed from predictions.jsonl {_short(rescored.get(key))}, the report says "
                            f"{_short(metrics.get(key))}")
        left_out = not_rescored(metrics, rescored)
        if left_out:  # a run without --save-logits: its probability scores cannot be recomputed
            findings.skip(f"{', '.join(left_out)} and their intervals (predictions.jsonl has no logits: --save-logits "
                          "at the run)")
        if not differ:
            findings.ok(f"every {'other ' if left_out else ''}metric and interval recomputed from predictions.jsonl "
                        "equals the report")
    _check_rows(rows, findings)
    try:
        keys, labels = hex_keys([r["key"] for r in rows]), np.array([r["label"] for r in rows], dtype=np.int64)
        got = rows_digest(keys, labels)
    except (KeyError, ValueError, TypeError) as e:
        got = f"unreadable ({type(e).__name__}: {e})"
    want = (receipt.get("data") or {}).get("rows_digest")
    if got != want:
        findings.differ(f"the rows of predictions.jsonl (content keys and labels): digest {got[:16]}..., the "
                        f"receipt says {str(want)[:16]}...")
    else:
        findings.ok(f"the {len(rows)} rows of predictions.jsonl are the receipt's (content keys and labels)")
    return metrics, receipt, rows


def _check_rows(rows: list, findings: Findings) -> None:
    """Each row of predictions.jsonl consistent in itself, where it has its logits: ``pred`` their argmax,
    ``loss`` their cross-entropy at ``label`` (as the run computed it: bit for bit).
    """
    from dist_eval.metrics import per_sample_cross_entropy

    if not rows or "logits" not in rows[0]:
        findings.skip("each row's pred and loss against its logits (no logits in predictions.jsonl: --save-logits)")
        return
    wrong = []
    try:
        logits = np.array([r["logits"] for r in rows], dtype=np.float32)
        labels = np.array([r["label"] for r in rows], dtype=np.int64)
        losses = per_sample_cross_entropy(logits, labels)
        for number, (row, loss) in enumerate(zip(rows, losses.tolist())):
            argmax = int(np.argmax(logits[number]))
            if row["pred"] != argmax:
                wrong.append(f"row {number} of predictions.jsonl: pred {row['pred']}, its logits' argmax {argmax}")
            elif not (row["loss"] == loss or (loss != loss and row["loss"] != row["loss"])):
                wrong.append(f"row {number} of predictions.jsonl: loss {row['loss']!r}, its logits' cross-entropy "
                             f"{loss!r}")
    except (KeyError, ValueError, TypeError) as e:
        wrong.append(f"predictions.jsonl: rows unreadable ({type(e).__name__}: {e})")
    for line in wrong[:SHOWN_ROWS]:
        findings.differ(line)
    if len(wrong) > SHOWN_ROWS:
        findings.differ(f"... {len(wrong) - SHOWN_ROWS} more rows of predictions.jsonl disagree with their logits")
    if not wrong:
        findings.ok(f"each of the {len(rows)} rows' pred and loss agree with its logits")


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check_files(receipt: dict, args, findings: Findings) -> dict:
    """Step 2: every digest within reach. Returns where the model, checkpoint and data are."""
    from dist_eval.backends.checkpoint import checkpoint_digest
    from dist_eval.backends.provenance import file_digest

    model = receipt.get("model") or {}
    model_dir = args.model or model.get("path")
    if model_dir and os.path.isdir(model_dir):
        wrong = []
        for name, digest in sorted((model.get("files") or {}).items()):
            path = os.path.join(model_dir, name)
            got = file_digest(path) if os.path.isfile(path) else "missing"
            if got != digest:
                wrong.append(f"{name} ({'missing' if got == 'missing' else 'sha256 ' + got[:16] + '...'}, the "
                             f"receipt says {digest[:16]}...)")
        if wrong:
            findings.differ(f"--model {model_dir}: not the model the run read: {', '.join(wrong)}")
        else:
            findings.ok(f"--model {model_dir}: its {len(model.get('files') or {})} files are those the run read")
    else:
        findings.skip(f"the model's files ({model_dir}: not a folder here; pass --model DIR)")
    checkpoint, head = receipt.get("checkpoint"), receipt.get("head")
    where_checkpoint = args.checkpoint or (checkpoint or {}).get("path")
    if args.head and not head:
        raise UsageError("the run was given no --head (its receipt names none): expected none here. Drop --head.",
                         param="head", value=args.head)
    where_head = args.head or (head or {}).get("path")
    if checkpoint:
        _check_digest(findings, "checkpoint", where_checkpoint, checkpoint.get("sha256"), checkpoint_digest)
    if head and head.get("sha256"):
        _check_digest(findings, "head", where_head, head["sha256"], file_digest)
    elif head:
        findings.skip(f"the head ({head.get('path')}: the run recorded no digest of it)")
    data = (receipt.get("data") or {}).get("files") or []
    where_data = list(args.data_files) if args.data_files else [d.get("path") or d.get("hub") for d in data]
    if args.data_files and len(args.data_files) != len(data):
        raise UsageError(f"expected {len(data)} file(s), as the run read, got {len(args.data_files)}. Pass each of "
                         "the run's data files, in the run's order.", param="data_files", value=args.data_files)
    for recorded, path in zip(data, where_data):
        if "sha256" in recorded:
            if not os.path.isfile(path):
                findings.skip(f"the data file {path} (not a file here; pass --data-files)")
                continue
            got = file_digest(path)
            if got != recorded["sha256"]:
                findings.differ(f"--data-files {path}: sha256 {got[:16]}..., the receipt says "
                                f"{recorded['sha256'][:16]}...: another data file")
            else:
                findings.ok(f"--data-files {path} is the file the run read (sha256)")
        else:
            findings.skip(f"the data {path} (a folder or hub dataset: checked through its rows only)")
    return {"model": model_dir, "checkpoint": where_checkpoint, "head": where_head, "data": where_data}


def _check_digest(findings: Findings, what: str, where: Optional[str], want: str, digest) -> None:
    """The run's ``--{what}`` file, now at ``where``: its ``digest`` against the receipt's ``want``."""
    try:
        got = digest(where) if where else None
    except (OSError, UsageError, ValueError):
        got = None
    if got is None:
        findings.skip(f"the {what} ({where}: not readable here; pass --{what} FILE)")
    elif got != want:
        findings.differ(f"--{what} {where}: sha256 {got[:16]}..., the receipt says {str(want)[:16]}...: another {what}")
    else:
        findings.ok(f"--{what} {where} is the {what} the run read (sha256)")


def same_numerics(receipt: dict, backend: str, device: str = "cpu") -> bool:
    """The verifier (``--device``) computes as the run did: the same libraries, device, instruction set and threads,
    and a swarm of float32 replicas without quantization (the local backend equals it bit for bit where they compute
    as the verifier does: what a server computes on is not in the receipt, so a swarm's rows that differ in their
    last bits are taken within the tolerance, and said: :func:`evaluate_again`).
    """
    from dist_eval.receipt import numerics

    if backend != "local":
        return False
    recorded = dict(receipt.get("numerics") or {})
    servers = recorded.pop("servers", None) or []
    here = numerics(device)
    if any(recorded.get(k) != here.get(k) for k in ("torch", "transformers", "device", "cpu_capability", "threads",
                                                    "dtype", "gpu")):
        return False
    return all("float32" in str(s.get("torch_dtype")) and str(s.get("quantization")).lower() in ("none", "")
               or s.get("quantization") is None and "float32" in str(s.get("torch_dtype")) for s in servers)


def chance_to_pass(rows: int, checked: int, wrong_share: float = 0.01) -> float:
    """The chance that ``checked`` rows drawn without replacement from ``rows`` miss every one of the
    ceil(wrong_share x rows) wrong rows (hypergeometric).
    """
    wrong = math.ceil(wrong_share * rows)
    if checked + wrong > rows:
        return 0.0
    return math.exp(math.lgamma(rows - wrong + 1) - math.lgamma(rows - wrong - checked + 1)
                    - math.lgamma(rows + 1) + math.lgamma(rows - checked + 1))


def _settings(receipt: dict):
    """The run's :class:`~dist_eval.config.Settings`, from the receipt."""
    from dist_eval.config import Settings

    names = set(Settings.__dataclass_fields__)
    return Settings(**{k: (tuple(v) if k == "label_words" and v else v)
                       for k, v in (receipt.get("settings") or {}).items() if k in names})


def _load(receipt: dict, where: dict, args, settings):
    """(the run's rows drawn from the data again, the tokenizer, the model loaded with ``--backend``: local's
    blocks streamed from disk one at a time, :mod:`dist_eval.backends.streamed`, unless ``--in-memory``).
    """
    from dist_eval.backends import load_model
    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.data.load import load_split
    from dist_eval.data.sample import draw_rows

    recorded = receipt.get("settings") or {}
    if not where["model"] or not os.path.isdir(where["model"]):
        raise UsageError(f"expected the model's folder to evaluate rows again, got {where['model']!r}. Pass "
                         "--model DIR (the receipt's files are checked against it).", param="model",
                         value=where["model"])
    drawn = draw_rows(load_split(where["data"], recorded.get("split")), settings)
    tokenizer = load_tokenizer(where["model"])
    model = load_model(args.backend, where["model"], checkpoint=where["checkpoint"] if receipt.get("checkpoint")
                       else None, head=where["head"],
                       tuning_mode=recorded.get("tuning_mode"), pre_seq_len=recorded.get("pre_seq_len") or 0,
                       num_labels=recorded.get("num_labels"), initial_peers=args.initial_peers,
                       dht_prefix=args.dht_prefix, device=args.device, label_words=settings.label_words,
                       tokenizer=tokenizer, audit=0.0, stream_blocks=args.backend == "local" and not args.in_memory)
    return drawn, tokenizer, model


def evaluate_again(receipt: dict, rows: list, where: dict, args, findings: Findings) -> int:
    """Step 3: a share of the rows evaluated again in the run's batches; returns the rows drawn and compared."""
    import torch

    from dist_eval.backends.objects import evaluation_task
    from dist_eval.data.labels import classes_of
    from dist_eval.receipt import RELATIVE_TOLERANCE, rows_digest

    settings = _settings(receipt)
    threads = (receipt.get("numerics") or {}).get("threads")
    if isinstance(threads, int) and threads > 0:
        torch.set_num_threads(threads)  # the run's summation order
    exact = (receipt.get("promise") or {}).get("same_numerics") == "bit for bit" and \
        same_numerics(receipt, args.backend, args.device)
    on_swarm = bool((receipt.get("numerics") or {}).get("servers"))  # their devices and threads not recorded
    drawn, tokenizer, model = _load(receipt, where, args, settings)
    report_rows = {int(r["index"]): r for r in rows if "index" in r}
    indices = np.array(sorted(report_rows), dtype=np.int64)
    try:
        with evaluation_task(model, None, None, None, settings.label_words) as task:
            labels, _ = classes_of(drawn.dataset, settings.label_column, task.num_labels,
                                   (receipt.get("settings") or {}).get("label_names") or task.label_names,
                                   task.label_words)
            keys = np.asarray(drawn.keys.keys, dtype=np.uint64)
            if len(indices) and indices.max() >= len(keys):
                findings.differ(f"the data holds {len(keys)} rows, predictions.jsonl has row {indices.max()}: "
                                "another data file")
                return 0
            got, want = rows_digest(keys[indices], labels[indices]), (receipt.get("data") or {}).get("rows_digest")
            if got != want:
                findings.differ(f"the data's rows (content keys and labels) are not the report's: digest {got[:16]}...,"
                                f" the receipt says {str(want)[:16]}...: another data file or other settings")
            seed = args.seed if args.seed is not None else secrets.randbits(63)
            count = min(len(indices), max(args.min_rows, math.ceil(args.share * len(indices))))
            chosen = set(np.random.default_rng(seed).choice(indices, size=count, replace=False).tolist())
            findings.say(f"{PROG}: evaluating {count} of {len(indices)} rows again (seed {seed}) with the "
                         f"{args.backend} backend, in the run's batches; logits compared "
                         f"{'bit for bit' if exact else f'within {RELATIVE_TOLERANCE:g} x (1 + |report|)'}",
                         flush=True)
            wrong, inexact = _compare_batches(task, drawn, tokenizer, labels, settings, chosen, report_rows,
                                              (exact, RELATIVE_TOLERANCE, on_swarm))
    finally:
        model.close()
    if inexact:  # a swarm's servers may compute on other devices or threads than the verifier
        exact = False
        findings.say(f"{PROG}: {len(inexact)} of the {count} rows differ from the report within the tolerance, not "
                     "bit for bit: the swarm's servers computed on other numerics than this verifier (their devices "
                     "and threads are not in the receipt); those taken within the tolerance", flush=True)
    for row, why in wrong[:SHOWN_ROWS]:
        findings.differ(f"row {row} (key {report_rows[row].get('key')}) evaluated again: {why}")
    if len(wrong) > SHOWN_ROWS:
        findings.differ(f"... {len(wrong) - SHOWN_ROWS} more rows of the {count} evaluated again differ")
    if not wrong:
        findings.ok(f"the {count} rows evaluated again agree with the report "
                    f"{'bit for bit' if exact else 'within the tolerance'}")
    return count


def _compare_batches(task, drawn, tokenizer, labels, settings, chosen: set, report_rows: dict, promise: tuple):
    """([(row, why)] of each ``chosen`` row whose logits, evaluated in its batch of the run's plan (the whole
    set's, every batch built as the run built it), differ from the report's under ``promise`` (exact, tolerance,
    lenient), [the rows that differ bit for bit but agree within the tolerance, where ``lenient``]).
    """
    from dist_eval.backends.families import tokenizers_calling_the_base
    from dist_eval.data.shard import dataset_batches
    from dist_eval.metrics import per_sample_cross_entropy
    from dist_eval.predict import _timed_forward

    batches, _, _ = dataset_batches(drawn.dataset, tokenizer, labels, settings, pad_token_id=task.pad_token_id,
                                    prefix_tokens=task.prompt_tokens, calling_the_base=tokenizers_calling_the_base())
    wrong, inexact = [], []
    for _, batch_rows, input_ids, batch_labels in batches:
        mine = [i for i, row in enumerate(batch_rows.tolist()) if row in chosen]
        if not mine:
            continue
        logits = _timed_forward(task.forward, input_ids)[0].numpy()
        losses = per_sample_cross_entropy(logits, np.asarray(batch_labels))
        for i in mine:
            why = judge_row(report_rows[int(batch_rows[i])], logits[i], float(losses[i]), promise)
            if why == LAST_BITS:
                inexact.append(int(batch_rows[i]))
            elif why:
                wrong.append((int(batch_rows[i]), why))
    return wrong, inexact


LAST_BITS = "last bits"  # judge_row: other bits within the tolerance, where the promise is lenient


def judge_row(reported: dict, logits: np.ndarray, loss: float, promise: tuple) -> Optional[str]:
    """Why a row evaluated again differs from the report under ``promise`` (exact, tolerance, lenient), or None;
    :data:`LAST_BITS` where it differs bit for bit but not beyond the tolerance and ``lenient``.
    """
    exact, tolerance, lenient = promise
    why = _row_differs(reported, logits, loss, exact, tolerance)
    if why and exact and lenient and not _row_differs(reported, logits, loss, False, tolerance):
        return LAST_BITS
    return why


def _row_differs(reported: dict, logits: np.ndarray, loss: float, exact: bool, tolerance: float) -> Optional[str]:
    def close(a: np.ndarray, b: np.ndarray) -> bool:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if exact:
            return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))
        return a.shape == b.shape and bool(np.all(np.abs(a - b) <= tolerance * (1 + np.abs(b))))

    if "logits" in reported:
        stored = np.asarray(reported["logits"], dtype=np.float32)
        if not close(logits.astype(np.float32), stored):
            diff = float(np.max(np.abs(logits.astype(np.float64) - stored.astype(np.float64)))) \
                if logits.shape == stored.shape else float("nan")
            return f"logits differ from the report's by up to {diff:.3g} ({'bit for bit' if exact else 'tolerance'})"
    elif not close(np.array([loss]), np.array([reported.get("loss", float("nan"))])):
        return f"loss {loss!r}, the report says {reported.get('loss')!r}"
    if int(np.argmax(logits)) != reported.get("pred"):
        return f"predicted class {int(np.argmax(logits))}, the report says {reported.get('pred')}"
    return None


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (also docs/cli.md's source)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Check a finished run's report against its receipt (metrics.json's run.receipt): the files' "
        "digests, every metric recomputed from predictions.jsonl, and with --backend a share of the rows evaluated "
        "again. Exit 0 when everything checked agrees, 1 when something differs, 2 when OUT has no receipt.",
    )
    parser.add_argument("run", metavar="OUT", help="output folder of a finished run")
    parser.add_argument("--backend", choices=["local", "petals"], default=None,
                        help="evaluate a share of the rows again with this backend (none: the files and metrics only)")
    parser.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                        help="--backend petals: the swarm to evaluate with")
    parser.add_argument("--dht-prefix", default=None, help="--backend petals: the model's DHT prefix on that swarm")
    parser.add_argument("--device", default="cpu", help="--backend local: where to compute (cpu; cuda or cuda:K with "
                        "--in-memory)")
    parser.add_argument("--in-memory", action="store_true",
                        help="--backend local: load the whole model in memory (default: its blocks streamed from disk "
                        "one at a time, the same logits bit for bit, the memory of one block)")
    parser.add_argument("--share", type=float, default=DEFAULT_SHARE,
                        help="share of the rows evaluated again (at least --min-rows, or every row when fewer)")
    parser.add_argument("--min-rows", type=int, default=DEFAULT_MIN_ROWS, help="rows evaluated again at least")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the rows drawn (default: drawn by the verifier, printed)")
    parser.add_argument("--key", default=None, metavar="PUBLIC_KEY",
                        help="the public key that must have signed the receipt (--sign at the run): a PEM file or "
                        "64 hex digits")
    parser.add_argument("--model", default=None, help="the model's folder, where it is now (default: the receipt's)")
    parser.add_argument("--checkpoint", default=None, help="the checkpoint, where it is now (default: the receipt's)")
    parser.add_argument("--head", default=None, help="the --head file of the run, where it is now (default: the "
                        "receipt's)")
    parser.add_argument("--data-files", nargs="+", default=None,
                        help="the data files, where they are now, in the run's order (default: the receipt's)")
    return parser


def _check_args(args) -> None:
    if not 0 < args.share <= 1:
        raise UsageError("expected a share in (0, 1] of the rows to evaluate again. Pass e.g. --share 0.02.",
                         param="share", value=args.share)
    if args.seed is not None and args.seed < 0:
        raise UsageError("expected a seed >= 0. Pass e.g. --seed 3, or none (the verifier draws one).", param="seed",
                         value=args.seed)
    if args.min_rows < 0:
        raise UsageError("expected a number of rows >= 0. Pass e.g. --min-rows 300.", param="min_rows",
                         value=args.min_rows)
    if args.backend == "petals" and not args.initial_peers:
        raise UsageError("--backend petals evaluates on a swarm: expected its --initial-peers, got none. Pass "
                         "--initial-peers MADDR ... (and --dht-prefix), or use --backend local.",
                         param="initial_peers", value=None)


def verify(folder: str, args, say=print) -> int:
    """Every check; the verdict line; the exit code."""
    findings = Findings(say)
    _, receipt, rows = check_report(folder, findings, _public_key_hex(args.key) if args.key else None)
    where = check_files(receipt, args, findings)
    compared = evaluate_again(receipt, rows, where, args, findings) if args.backend else 0
    n = len(rows)
    if compared:
        chance = chance_to_pass(n, compared)
        odds = (f"a report wrong on 1% of its {n} rows would have passed the {compared} rows evaluated again with "
                f"chance {chance:.3g}")
    else:
        why = "none compared" if args.backend else "no --backend"
        odds = (f"no row evaluated again ({why}): a report wrong on 1% of its rows, its metrics computed from "
                "those rows, would have passed with chance 1")
    unchecked = f"; not checked: {len(findings.unchecked)}" if findings.unchecked else ""
    if findings.differs:
        say(f"{PROG}: NOT VERIFIED: {len(findings.differs)} finding(s) above; {odds}", flush=True)
        return EXIT_DIFFERS
    say(f"{PROG}: VERIFIED: {len(findings.checked)} check(s) agree{unchecked}; {odds}", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from dist_eval.backends.compat import quiet_third_party_output
    from dist_eval.errors import flag_names

    quiet_third_party_output()
    args = build_parser().parse_args(argv)
    with flag_names():  # errors name --flags
        try:
            _check_args(args)
            return verify(args.run, args)
        except UsageError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
