"""``python -m dist_eval.shard_merge SHARD_DIR... --output-dir OUT`` (or ``dist-eval merge ...``):
the report of the whole set from its shards, launched apart (``--shard I/K``: a job array, other
machines, other times, any number of ranks each).

Each shard's folder holds its finished rows (:mod:`dist_eval.output.shard_files`). They are checked first,
each refusal one line naming the shard: a shard missing or given twice, a shard of another split, of another
model, checkpoint, data or settings (the run key), or of other report options, or run on another device kind
or under another version of a library that computes a row (torch, transformers, tokenizers, ...:
:data:`NUMERICS_PACKAGES`) or of dist_eval, a shard unfinished. The rows are then merged by the run's own
merge (:func:`dist_eval.merge.merge_gathered`: ordered by row index, the first copy of a row kept, every row
of the set required), the metrics and intervals computed by the same functions a run's rank 0 calls, and the
report written by the run's writer (:func:`dist_eval.output.report.write_report`): the same metrics,
intervals, slices and predictions.jsonl, bit for bit, as one run over the whole set with the same settings (a
shard's batches are those of the whole set's plan), ``--cluster-by``'s clustered intervals included (each
row's cluster is in its shard's files).

``--partial``: the shards that finished, with the missing shards and rows counted in
``metrics.json``'s ``partial`` and said on the terminal; not a report of the set.
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dist_eval.backends.provenance import KEYED_LIBRARIES
from dist_eval.errors import UsageError, flag_names, warn
from dist_eval.loop_facts import LoopFacts, RunFacts, StoreFacts
from dist_eval.merge import CoverageError, merge_gathered
from dist_eval.output.shard_files import MANIFEST, read_manifest, read_rows
from dist_eval.scoring import rows_report

EXIT_USAGE = 2
PROG = "python -m dist_eval.shard_merge"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Merge the folders of a run's shards (--shard I/K) into the report of the whole set, equal "
                    "bit for bit to one run over every row with the same settings.")
    parser.add_argument("shard_dirs", nargs="+", metavar="SHARD_DIR", help="The --output-dir of each shard.")
    parser.add_argument("--output-dir", required=True, help="Where the merged report goes.")
    parser.add_argument("--partial", action="store_true",
                        help="Report the shards that finished, marked partial, with the missing shards and rows "
                             "counted (else a missing or unfinished shard is refused).")
    parser.add_argument("--quiet", action="store_true", help="Print only errors and the one-line result.")
    return parser


class _Shard(SimpleNamespace):
    folder: str
    index: int
    count: int
    manifest: dict
    indices: np.ndarray  # its rows (set by merged_rows)


def _name(shard: _Shard) -> str:
    return f"shard {shard.index}/{shard.count} ({shard.folder})"


def _read_shards(folders: Sequence[str], partial: bool) -> List[_Shard]:
    """The finished shards of ``folders``; an unfinished one refused (skipped, said, with ``partial``)."""
    shards = []
    for folder in folders:
        try:
            manifest = read_manifest(folder)
        except (OSError, ValueError) as e:
            raise UsageError(f"{folder}: not a shard's folder ({e}). Pass the --output-dir of a run with --shard.") \
                from e
        if manifest is None:
            what = "no such folder" if not os.path.isdir(folder) else "its run has not finished (no shard.json)"
            if not partial:
                raise UsageError(f"{folder}: unfinished shard: {what}. Rerun that shard's command (it resumes "
                                 "where it stopped), or pass --partial to report the shards that finished.")
            warn(f"--partial: {folder} left out: {what}")
            continue
        index, count = (int(part) for part in manifest["shard"].split("/"))
        shards.append(_Shard(folder=folder, index=index, count=count, manifest=manifest))
    if not shards:
        raise UsageError("no shard has finished: nothing to report. Rerun the shards' commands (each resumes "
                         "where it stopped).")
    return shards


def _differs(first: dict, other: dict) -> Optional[str]:
    """What of ``other``'s run key and report options differs from ``first``'s, named; None: nothing.
    The files may differ in place and order where the rows, in evaluation order, do not.
    """
    if first["rows_key"] != other["rows_key"]:
        return (f"other rows, or the same in another order (data files {other['named']['data_files']}, not "
                f"{first['named']['data_files']}; give every shard the files in one order, or a --limit sample, "
                "which is in the rows' content order whatever the files' order)")
    for part in ("report", "named"):  # what the key is made of: named where the keys differ
        if part == "named" and first["run_key"] == other["run_key"]:
            break
        # a name one shard lacks (written before it was recorded) is not compared, as the columns' key is not
        for name in sorted((set(first[part]) & set(other[part])) - {"data_files"}):
            a, b = first[part].get(name), other[part].get(name)
            if isinstance(a, dict) and isinstance(b, dict):
                inner = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), None)
                if inner is not None:
                    return f"{inner} {b.get(inner)!r}, not {a.get(inner)!r}"
            elif a != b:
                return f"{name} {b!r}, not {a!r}"
    keys = (first.get("columns_key"), other.get("columns_key"))  # None: no such columns, or a shard from before
    if None not in keys and keys[0] != keys[1]:  # the same rows, other slices or clusters
        return (f"other values in the --slice-by / --cluster-by columns (data files {other['named']['data_files']}, "
                f"not {first['named']['data_files']}; give every shard the same files)")
    if first["run_key"] != other["run_key"]:
        return f"run key {other['run_key']}, not {first['run_key']} (the model's files or the checkpoint)"
    if first["rows_in_set"] != other["rows_in_set"]:
        return f"a set of {other['rows_in_set']} rows, not {first['rows_in_set']}"
    return None


def check_shards(shards: List[_Shard], partial: bool) -> List[int]:
    """Refuse in one line naming the shard: another split, another run, a shard twice, one missing
    (unless ``partial``). Returns the missing shards' indices.
    """
    first = shards[0]
    seen: Dict[int, _Shard] = {}
    for shard in shards:
        if shard.count != first.count:
            raise UsageError(f"{_name(shard)}: a shard of {shard.count}, but {_name(first)} is one of {first.count}. "
                             f"Pass the shards of one split (one --shard I/{first.count} each).")
        differs = _differs(first.manifest, shard.manifest)
        if differs:
            raise UsageError(f"{_name(shard)}: another run than {_name(first)}: {differs}. Pass the shards of one "
                             "run (the same model, checkpoint, data and settings), or run this shard again so.")
        if shard.index in seen:
            raise UsageError(f"shard {shard.index}/{shard.count} given twice: {seen[shard.index].folder} and "
                             f"{shard.folder}. Pass each shard's folder once.")
        seen[shard.index] = shard
    missing = [i for i in range(first.count) if i not in seen]
    if missing and not partial:
        raise UsageError(f"shard {missing[0]}/{first.count} missing ({len(missing)} of {first.count} missing: "
                         f"{', '.join(f'{i}/{first.count}' for i in missing[:8])}). Pass its folder, or --partial to "
                         "report the shards given.")
    return missing


def shard_files(shards: List[_Shard]) -> Tuple[List[dict], List[dict]]:
    """(each shard's metrics.json, each shard's shard.npz arrays), read before the merge's folder is touched; a
    shard whose files cannot be read (copied in part, written meanwhile) refused in one line naming it.
    """
    import json
    import zipfile

    metrics_of, payloads = [], []
    for shard in shards:
        try:
            with open(os.path.join(shard.folder, "metrics.json")) as f:
                metrics_of.append(json.load(f))
            payloads.append(read_rows(shard.folder))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise UsageError(f"{shard.folder}: shard {shard.index}/{shard.count}'s files cannot be read "
                             f"({type(e).__name__}: {e}): copied in part, or written meanwhile. Copy the shard's "
                             "folder whole, or rerun its command.") from e
    return metrics_of, payloads


# the packages whose versions decide a row's tokens or floats (kernels, the blocks' code, the tokenizer: the row
# store's KEYED_LIBRARIES, and dist_eval): not in the shards' key, which a moved install keeps, yet shards computed
# under others are not one run's rows
NUMERICS_PACKAGES = (*KEYED_LIBRARIES, "dist_eval")


def check_versions(shards: List[_Shard], metrics_of: List[dict]) -> None:
    """Refuse in one line naming the shard one whose run had another version of :data:`NUMERICS_PACKAGES`
    (each shard's metrics.json; a version a shard did not record is not compared).
    """
    def versions(metrics: dict) -> dict:
        return (metrics.get("run") or {}).get("versions") or {}

    for package in NUMERICS_PACKAGES:  # the first shard recording a version, against each later one that does
        recorded = [(shard, versions(metrics).get(package)) for shard, metrics in zip(shards, metrics_of)]
        recorded = [(shard, version) for shard, version in recorded if version]
        for shard, have in recorded[1:]:
            first, want = recorded[0]
            if have != want:
                again = ("the code of that version (its files' digest: the same commit)" if package == "dist_eval"
                         else f"{package} {want}")
                raise UsageError(f"{_name(shard)}: another run than {_name(first)}: {package} {have}, not {want} "
                                 f"(its tokens or floats may differ). Run every shard with one install, or this shard "
                                 f"again with {again}.")


def merged_rows(shards: List[_Shard], payloads: List[dict], partial: bool):
    """(the shards' rows (``payloads``: :func:`shard_files`'s) as one MergedResults, by row index: the run's own
    merge), every row of the set required unless ``partial``.
    """
    rows_in_set = shards[0].manifest["rows_in_set"]
    for shard, payload in zip(shards, payloads):
        shard.indices = payload["indices"].copy()  # the merge consumes the payloads
    expected = np.sort(np.concatenate([p["indices"] for p in payloads])) if partial else None
    try:
        return merge_gathered(payloads, rows_in_set, expected)
    except CoverageError as e:
        raise UsageError(f"the shards do not hold the rows of the set: {e}. Run each shard again.") from e


def loop_facts(parts: List[LoopFacts]) -> LoopFacts:
    """The shards' loops as one run's: their ranks side by side, counts and seconds added up."""
    store = parts[0].row_store
    for part in parts[1:]:
        store = store + part.row_store
    return LoopFacts(
        world_size=sum(p.world_size for p in parts),
        per_rank_samples=[n for p in parts for n in p.per_rank_samples],
        eval_loop_seconds=max(p.eval_loop_seconds for p in parts),
        forward_seconds_sum=sum(p.forward_seconds_sum for p in parts),
        loop_cpu_seconds_sum=sum(p.loop_cpu_seconds_sum for p in parts),
        duplicates_dropped=sum(p.duplicates_dropped for p in parts),
        max_batch_seconds=max(p.max_batch_seconds for p in parts),
        resumed_samples=sum(p.resumed_samples for p in parts),
        num_truncated=sum(p.num_truncated for p in parts),
        row_store=store if isinstance(store, StoreFacts) else StoreFacts(),
    )


def _texts(shards: List[_Shard], rows_in_set: int) -> Tuple[Optional[dict], Optional[dict]]:
    """(predictions.jsonl's texts and slices of every row, by row index; the slice values by column)."""
    texts: Dict[str, list] = {}
    for shard in shards:
        manifest = shard.manifest
        indices = shard.indices.tolist()
        for key, values in manifest["texts"].items():
            column = texts.setdefault(key, [None] * rows_in_set)
            for i, value in zip(indices, values):
                column[i] = value
    slices = None
    if "slice" in texts:
        named = next(row for row in texts["slice"] if row is not None)
        slices = {column: [row[column] if row is not None else None for row in texts["slice"]] for column in named}
    return texts or None, slices


def merge_shards(folders: Sequence[str], output_dir: str, *, partial: bool = False, quiet: bool = False) -> dict:
    """Merge the shards in ``folders`` into the report of the whole set in ``output_dir`` (see the
    module); returns its metrics.
    """
    from dist_eval.output.files import check_output_dir, hold_output_dir, release_output_dirs
    from dist_eval.output.report import write_report
    from dist_eval.output.shard_files import discard_shard
    from dist_eval.receipt import merged as merged_receipt

    if os.path.lexists(os.path.join(output_dir, MANIFEST)):
        raise UsageError(f"{output_dir} holds a shard (its shard.json): the merged report would replace it. Pass "
                         "another folder.", param="output_dir", value=output_dir)
    shards = _read_shards(folders, partial)
    missing = check_shards(shards, partial)
    shards.sort(key=lambda s: s.index)
    manifest = shards[0].manifest
    metrics_of, payloads = shard_files(shards)
    check_versions(shards, metrics_of)
    check_output_dir(output_dir)
    hold_output_dir(output_dir)
    try:
        discard_shard(output_dir)
        merged = merged_rows(shards, payloads, partial)
        report = _report(shards, metrics_of, merged, missing)
        texts, _ = _texts(shards, manifest["rows_in_set"])
        options = manifest["report"]
        config = SimpleNamespace(save_logits=options["save_logits"], quiet=quiet, report_to="none")
        receipts = [(m.get("run") or {}).get("receipt") for m in metrics_of]
        receipt = None if texts is None or "key" not in texts or missing else (
            lambda path: merged_receipt(receipts, report, merged, texts["key"], path))
        write_report(config, output_dir, SimpleNamespace(metrics=report, predictions=merged),
                     print if not quiet else (lambda *a, **k: None), texts, receipt)
    finally:
        release_output_dirs()
    if report.get("partial"):
        part = report["partial"]
        print(f"dist_eval: PARTIAL report: {part['rows']} of {part['rows_in_set']} rows ({part['missing_rows']} "
              f"missing; shards missing: {', '.join(part['missing_shards'])}) -> {output_dir}", flush=True)
    return report


def _report(shards: List[_Shard], metrics_of: List[dict], merged, missing: List[int]) -> dict:
    """metrics.json of the merged rows: the run's metrics (rows_report, as rank 0 computes them), its
    slices, the shards' loops as one, the first shard's run facts naming the shards.
    """
    from dist_eval.slices import clustered_metrics, slice_report

    manifest, first = shards[0].manifest, metrics_of[0]
    options = manifest["report"]
    bootstrap = (options["bootstrap_resamples"], options["bootstrap_seed"])
    report = rows_report(merged, first["num_labels"], first.get("label_names"), None, (bootstrap, options["top_k"]))
    loops = [LoopFacts.from_report(m) for m in metrics_of]
    facts = loop_facts(loops).report()
    report.update(facts)
    texts, slices = _texts(shards, manifest["rows_in_set"])
    clusters = None
    if options.get("cluster_by") is not None:  # as the run's rank 0: every interval resamples whole clusters
        clusters = (options["cluster_by"], texts["cluster"])
        report = clustered_metrics(report, merged, clusters, bootstrap)
    if slices is not None:
        report["slices"] = slice_report(merged, slices, report["num_labels"], report.get("label_names"),
                                        (bootstrap, report.get("top_k")), manifest["rows_in_set"], clusters)
    run = RunFacts.of_shards([RunFacts.of(m) for m in metrics_of], [loop.world_size for loop in loops],
                             [{"shard": f"{s.index}/{s.count}", "folder": os.path.abspath(s.folder),
                               "rows": s.manifest["rows"]} for s in shards])
    report["run"] = {**facts["run"], **run.report()}
    if missing:
        count = shards[0].count
        report["partial"] = {"rows": merged.num_samples, "rows_in_set": manifest["rows_in_set"],
                             "missing_rows": manifest["rows_in_set"] - merged.num_samples,
                             "missing_shards": [f"{i}/{count}" for i in missing]}
    return report


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    with flag_names():  # errors name --output-dir, not output_dir=
        try:
            merge_shards(args.shard_dirs, args.output_dir, partial=args.partial, quiet=args.quiet)
        except UsageError as e:
            print(f"dist_eval: error: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
