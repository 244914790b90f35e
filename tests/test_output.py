"""The report a user reads: bootstrap intervals (seeded, order- and N-independent, right
against a plain bootstrap), the files (CSV, Markdown, PNG, self-contained HTML) with
class names, the report without matplotlib, and --report-to."""
import base64
import copy
import csv
import io
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
from conftest import run_ranks, write_csv
from float_promises import assert_same_bits
from inprocess_cli import one_thread, run_cli_in_process

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLASS_NAMES = ["negative", "neutral", "positive"]


# --- the intervals, as a pure function ---------------------------------------------------


# --- a real 2-rank run over a dataset whose label column is a ClassLabel ------------------


@pytest.fixture(scope="module")
def named_data(tmp_path_factory):
    import datasets

    base = tmp_path_factory.mktemp("named")
    csv_path = write_csv(str(base / "data.csv"), 41, seed=21)
    ds = datasets.load_dataset("csv", data_files=csv_path, split="train")
    ds = ds.cast_column("label", datasets.ClassLabel(names=CLASS_NAMES))
    ds.save_to_disk(str(base / "ds"))
    return str(base / "ds")


@pytest.fixture(scope="module")
def two_rank_run(tiny_model, tiny_checkpoint, named_data, tmp_path_factory, rank_zygote):
    out = tmp_path_factory.mktemp("report") / "out"
    proc = run_ranks(  # two ranks forked (conftest's run_ranks): the report is tested, not the launch
        rank_zygote,
        [
            "--model",
            tiny_model,
            "--data-files",
            named_data,
            "--backend",
            "local",
            "--checkpoint",
            tiny_checkpoint,
            "--output-dir",
            str(out),
            "--batch-size",
            "4",
            "--progress",
            "log",
            "--bootstrap-seed",
            "3",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def one_process_result(tiny_model, tiny_checkpoint, named_data):
    """The same evaluation through the Python API, in this (single) process, with one thread as a
    torchrun rank computes (two threads may round a reduction otherwise)."""
    import datasets
    from transformers import AutoTokenizer

    from dist_eval import evaluate, load_model

    model = load_model("local", tiny_model, checkpoint=tiny_checkpoint)
    try:
        with one_thread():
            return evaluate(
                model,
                datasets.load_from_disk(named_data),
                tokenizer=AutoTokenizer.from_pretrained(tiny_model),
                batch_size=4,
                bootstrap_seed=3,
            )
    finally:
        model.close()


@pytest.mark.multiproc
def test_intervals_identical_for_one_and_two_ranks(two_rank_run, one_process_result):
    metrics = json.load(open(two_rank_run[0] / "metrics.json"))
    assert metrics["run"]["world_size"] == 2
    ci = metrics["confidence_intervals"]
    assert_same_bits(ci, one_process_result.metrics["confidence_intervals"], "the intervals, N=2 against 1")
    assert (ci["resamples"], ci["seed"], ci["level"], ci["method"]) == (1000, 3, 0.95, "bootstrap-percentile")
    for name in ("accuracy", "f1_macro", "loss"):
        assert ci[name][0] <= metrics[name] <= ci[name][1], name
    stdout = two_rank_run[1].stdout
    assert (
        f"95% CI (bootstrap, 1000 resamples, seed 3): acc [{ci['accuracy'][0]:.4f}, {ci['accuracy'][1]:.4f}]" in stdout
    )
    assert len(re.findall(r"(?<!\w)accuracy \d", stdout)) == 1  # the summary's one "accuracy X.XXXX" line


@pytest.mark.multiproc
def test_progress_counts_the_rows_of_every_rank(two_rank_run):
    out, proc = two_rank_run
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dist_eval: progress")]
    assert lines, proc.stderr[-3000:]
    assert re.match(r"dist_eval: progress 41/41 samples \(100%\), .*, done$", lines[-1]), lines[-1]
    assert re.search(r"^  accuracy \d\.\d{4}", proc.stdout, re.M) and "progress" not in proc.stdout


@pytest.mark.multiproc
def test_report_files_are_complete_and_valid(two_rank_run):
    out, proc = two_rank_run
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["label_names"] == CLASS_NAMES
    # confusion_matrix.png: a real PNG of a sensible size
    png = (out / "confusion_matrix.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    # per_class.csv: parses, class names, the numbers of metrics.json
    rows = list(csv.DictReader(io.StringIO((out / "per_class.csv").read_text())))
    assert [r["class"] for r in rows] == CLASS_NAMES
    for r in rows:
        expected = metrics["per_class"][r["class"]]
        assert float(r["f1"]) == pytest.approx(expected["f1"], abs=1e-12)
        assert int(r["support"]) == expected["support"]
    cm = np.array(metrics["confusion_matrix"])
    assert [int(r["predicted"]) for r in rows] == cm.sum(axis=0).tolist()
    markdown = (out / "per_class.md").read_text()
    assert all(f"| {name} |" in markdown for name in CLASS_NAMES) and "**macro avg**" in markdown
    # report.html: self-contained, the metrics with their intervals, names, the embedded figure
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page)  # nothing fetched from elsewhere
    embedded = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1)) == png
    ci = metrics["confidence_intervals"]
    assert f"{metrics['accuracy']:.4f}" in page and f"[{ci['accuracy'][0]:.4f}, {ci['accuracy'][1]:.4f}]" in page
    assert f"{metrics['f1_macro']:.4f}" in page and f"[{ci['loss'][0]:.4f}, {ci['loss'][1]:.4f}]" in page
    assert all(f"<td>{name}</td>" in page for name in CLASS_NAMES)
    assert "1000 resamples, seed 3" in page
    assert "report.html" in proc.stdout


def test_report_without_matplotlib(one_process_result, tmp_path, monkeypatch, capsys):
    import sys

    from dist_eval.output.files import write_report_files

    # as if not installed: the package and every submodule an earlier test imported
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = write_report_files(str(tmp_path), one_process_result.metrics)
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line] == [
        "dist_eval: warning: matplotlib is not installed, so confusion_matrix.png was not written "
        "(pip install matplotlib); report.html shows the matrix as a table"
    ]
    assert not (tmp_path / "confusion_matrix.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["per_class.csv", "per_class.md", "report.html"]
    assert len(written) == 3
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png" not in page and "matplotlib is not installed" in page
    for row in one_process_result.metrics["confusion_matrix"]:  # the matrix as a table instead
        assert "".join(f'<td class="num">{v}</td>' for v in row) in page


class _PageText(HTMLParser):
    """The elements and the text a browser would make of a page."""

    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_report_shows_markup_in_texts_as_text(one_process_result):
    """report.html's template escapes every text of a run (autoescape): class names, a data
    file, the title with markup in them are shown as text, never made elements."""
    from dist_eval.output.html import render_html

    metrics = copy.deepcopy(one_process_result.metrics)
    hostile = ["<script>alert(1)</script>", "a & b <b>bold</b>", '"><img src=x onerror=alert(2)>']
    renamed = dict(zip(CLASS_NAMES, hostile))
    metrics["label_names"] = hostile
    metrics["per_class"] = {renamed.get(name, name): row for name, row in metrics["per_class"].items()}
    metrics["run"]["data_files"] = ["<script>alert(3)</script>.csv"]
    page = render_html(metrics, title="<script>alert(4)</script> report")
    parsed = _PageText()
    parsed.feed(page)
    assert not {"script", "b"} & set(parsed.tags) and "img" not in parsed.tags  # no figure given: no <img> at all
    text = "".join(parsed.text)
    assert all(text.count(name) >= 3 for name in hostile)  # per-class table and both heads of the confusion table
    assert "<script>alert(3)</script>.csv" in text and text.count("<script>alert(4)</script> report") == 2
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&#34;&gt;&lt;img src=x" in page


def test_bootstrap_off_leaves_no_intervals(tiny_model, tiny_checkpoint, tmp_path, capfd):
    data = write_csv(str(tmp_path / "d.csv"), 11, seed=3)
    code = run_cli_in_process(
        [
            "--model",
            tiny_model,
            "--data-files",
            data,
            "--backend",
            "local",
            "--checkpoint",
            tiny_checkpoint,
            "--output-dir",
            str(tmp_path / "out"),
            "--bootstrap-resamples",
            "0",
            "--progress",
            "none",
            "--report-to",
            "none",
        ],
        hide_modules=("wandb", "tensorboard"),
    )
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]  # --report-to none needs neither wandb nor tensorboard
    metrics = json.load(open(tmp_path / "out" / "metrics.json"))
    assert "confidence_intervals" not in metrics and "CI" not in out
    assert "No confidence intervals" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.parametrize("tracker,package", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_report_to_a_missing_package_fails_before_any_work(tracker, package, tmp_path, capfd, monkeypatch):
    import dist_eval.demo

    out_dir = tmp_path / "never"
    monkeypatch.setenv("DIST_EVAL_CACHE", str(tmp_path / "empty_cache"))

    def no_build(*args, **kwargs):
        raise AssertionError("the demo was built before the flags were checked")

    monkeypatch.setattr(dist_eval.demo, "_install", no_build)
    # no --model: it would be the demo, which builds a model first; the check must come before
    code = run_cli_in_process(["--report-to", tracker, "--output-dir", str(out_dir)], hide_modules=(package,))
    out, err = capfd.readouterr()
    assert code == 2
    assert err.splitlines() == [
        f"dist_eval: error: --report-to {tracker}: the {package} package is not installed in this environment "
        f"({__import__('sys').executable}). Install it (pip install {package}) or pass --report-to none."
    ]
    assert not out_dir.exists()  # refused before the demo's build or any other work


def test_a_figure_that_fails_costs_only_the_figure(one_process_result, tmp_path, monkeypatch):
    import dist_eval.output.figures
    from dist_eval.output.files import write_report_files

    def broken(*args, **kwargs):  # failure injection: e.g. a broken font cache
        raise RuntimeError("no fonts")

    monkeypatch.setattr(dist_eval.output.figures, "confusion_matrix_png", broken)
    monkeypatch.setattr(dist_eval.output.figures, "reliability_table_png", broken)
    warnings = []
    written = write_report_files(str(tmp_path), one_process_result.metrics, warn=warnings.append)
    assert warnings == [
        "confusion_matrix.png could not be drawn (RuntimeError: no fonts); report.html shows the matrix as a table",
        "reliability_diagram.png could not be drawn (RuntimeError: no fonts)",
    ]
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["per_class.csv", "per_class.md", "report.html"]
        and len(written) == 3
    )


def test_the_figures_drawn_aside_are_the_figures_drawn_here(one_process_result, tmp_path):
    """Issue 74: the report's figures drawn in a forked child (figures_aside at a set of aside's size) are the bytes
    drawn in this process, and the report files written from them too."""
    from dist_eval.chunks import chunk_rows
    from dist_eval.output.files import draw_figures, write_report_files
    from dist_eval.output.report import figures_aside

    metrics = one_process_result.metrics
    here = draw_figures(metrics)
    assert isinstance(here["confusion_matrix.png"], bytes) and isinstance(here.get("reliability_diagram.png"), bytes)
    with figures_aside(metrics, chunk_rows("aside")) as figures:
        assert figures.child is not None
        drawn = figures.drawn()
    assert drawn == here
    assert figures.child.pid is None  # reaped
    for name, figures in (("here", None), ("aside", drawn)):
        (tmp_path / name).mkdir()
        write_report_files(str(tmp_path / name), metrics, drawn=figures)
    for name in sorted(path.name for path in (tmp_path / "here").iterdir()):
        assert (tmp_path / "aside" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name


def _predictions_by_json_dumps(merged, label_names, save_logits, texts):
    """The reference: a dict per row, json.dumps'd (what write_predictions wrote before it
    built its lines a column at a time)."""
    from dist_eval.metrics import softmax

    probs = softmax(merged.logits)[np.arange(len(merged.indices)), merged.preds] if merged.logits is not None else None
    lines = []
    for i, index in enumerate(merged.indices.tolist()):
        row = {"index": index, "label": int(merged.labels[i]), "pred": int(merged.preds[i])}
        if label_names:
            row["label_name"] = label_names[merged.labels[i]]
            row["pred_name"] = label_names[merged.preds[i]]
        if probs is not None:
            row["prob"] = float(probs[i])
        row["loss"] = float(merged.losses[i])
        if save_logits and merged.logits is not None:
            row["logits"] = merged.logits[i].tolist()
        for key, values in (texts or {}).items():
            row[key] = values[index]
        lines.append(json.dumps(row) + "\n")
    return "".join(lines).encode()


@pytest.mark.parametrize("case", ["names_texts_logits", "plain", "no_logits", "texts_named_like_fields", "big"])
def test_predictions_lines_are_json_dumps_of_each_row(tmp_path, case):
    """predictions.jsonl byte for byte as json.dumps writes each row's dict: NaN and infinite
    values, quotes, escapes, non-ASCII and % in names, texts and keys, a text key that is also
    a field's, and more rows than one write holds."""
    from dist_eval.chunks import chunk_rows
    from dist_eval.merge import MergedResults
    from dist_eval.output.files import write_predictions

    rng = np.random.default_rng(len(case))
    n, k = (chunk_rows("lines") + 7, 4) if case == "big" else (60, 3)
    logits = (rng.normal(size=(n, k)) * 5).astype(np.float32)
    logits[0, 0], logits[1, 1], logits[2, :] = np.nan, np.inf, -np.inf
    losses = rng.exponential(size=n)
    losses[3:6] = [np.nan, np.inf, -np.inf]
    merged = MergedResults(indices=rng.permutation(n), labels=rng.integers(0, k, n),
                           preds=logits.argmax(axis=1), losses=losses,
                           logits=None if case == "no_logits" else logits)
    names = {"names_texts_logits": ["a", 'q"u\\o', "\u00fcn\u00ef %s \n"], "texts_named_like_fields": ["x", "y", "z"],
             "big": ["w", "x", "y", "z"]}.get(case)
    texts = {"names_texts_logits": {"text": [f"t%s{i} \u00e9\n\"" for i in range(n)],
                                    "te%xt": [str(i) for i in range(n)]},
             "texts_named_like_fields": {"label": ["L"] * n, "text": ["T"] * n}}.get(case)
    save_logits = case in ("names_texts_logits", "no_logits")
    with np.errstate(all="ignore"):
        path = write_predictions(str(tmp_path), merged, names, save_logits, texts)
        expected = _predictions_by_json_dumps(merged, names, save_logits, texts)
    with open(path, "rb") as f:
        assert f.read() == expected


def test_the_row_store_line_says_what_the_store_did():
    """Served rows and the time saved; a first run (nothing served) says where its rows were kept;
    --fresh-rows says none were read."""
    from dist_eval.output.summary import format_row_store

    store = {"folder": "/s", "fresh_rows": False, "rows_from_store": 300, "rows_evaluated": 500, "seconds_saved": 41.2}
    assert format_row_store(store) == "  300 rows from the row store, 500 evaluated; about 41.2 s saved (/s)"
    first = {**store, "rows_from_store": 0, "seconds_saved": 0.0}
    assert format_row_store(first) == "  row store: 500 rows evaluated and stored for later runs (/s)"
    fresh = {**first, "fresh_rows": True}
    assert format_row_store(fresh) == "  row store: --fresh-rows, none read; 500 evaluated and stored (/s)"
