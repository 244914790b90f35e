"""Metrics per slice (--slice-by, issue 39): each slice's metrics equal an evaluate() of the
slice alone; intervals only from MIN_INTERVAL_ROWS rows; the files, the summary, rescore and
compare per slice; bad input in one line."""
import csv
import json
import random

import pytest
from conftest import WORDS
from float_promises import assert_same_bits, assert_within_rounding
from inprocess_cli import one_thread, run_cli_in_process

from dist_eval.slices import MIN_INTERVAL_ROWS

# run_cli_in_process's hide_modules for a run whose figures no test looks at (matplotlib hidden: the figures
# are the same function of the same metrics, and most of a small run's report); the sliced run draws them
NO_FIGURES = ("matplotlib",)

LANGS = ("de", "en", "fr")
# One row a batch keeps each row's forward the same shape in the run and alone, but the slice alone is
# planned as a run of its own (its batches, ids and rows in flight), and issue 46's machine rounded the
# loss otherwise (4.633695609190301 in the run, 4.633695805291762 alone).
SLICE_ALONE = "the slice alone is planned as a run of its own"


def write_sliced_csv(path, num_rows: int, seed: int = 0) -> str:
    """Rows of random words, integer labels and a ``lang`` column (``en`` is most rows)."""
    r = random.Random(seed)
    with open(path, "w") as f:
        f.write("text,label,lang,source\n")
        for i in range(num_rows):
            text = " ".join(r.choice(WORDS) for _ in range(r.randint(1, 12)))
            lang = r.choice(("de", "en", "en", "en", "fr"))
            f.write(f"{text},{r.choice([0, 0, 1, 1, 2])},{lang},s{i % 2}\n")
    return str(path)


@pytest.fixture(scope="module")
def sliced(tiny_model, tiny_checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("sliced")
    data = write_sliced_csv(base / "data.csv", 90)
    out = base / "out"
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files", data,
            "--output-dir", str(out), "--slice-by", "lang", "source", "--bootstrap-resamples", "50",
            "--save-logits", "--progress", "none", "--batch-size", "1"]  # a row's logits: whatever rows surround it
    assert run_cli_in_process(args) == 0
    return base, data, out


@pytest.fixture(scope="module")
def loaded(tiny_model, tiny_checkpoint):
    from transformers import AutoTokenizer

    from dist_eval import load_model

    return load_model("local", tiny_model, checkpoint=tiny_checkpoint), AutoTokenizer.from_pretrained(tiny_model)


def _evaluate(loaded, dataset, **keywords):
    from dist_eval import evaluate

    model, tokenizer = loaded
    with one_thread():  # as the run's rank computes (two threads may round a reduction otherwise)
        return evaluate(model, dataset, tokenizer=tokenizer, return_logits=True, bootstrap_resamples=50, batch_size=1,
                        **keywords)


def test_each_slice_equals_evaluating_the_slice_alone(sliced, loaded):
    import datasets

    _, data, out = sliced
    metrics = json.load(open(out / "metrics.json"))
    slices = metrics["slices"]
    assert slices["columns"] == ["lang", "source", "token_length_quartile"] and slices["rows"] == 90
    assert sorted(slices["by"]["lang"]) == list(LANGS) and sorted(slices["by"]["source"]) == ["s0", "s1"]
    assert [q[:2] for q in sorted(slices["by"]["token_length_quartile"])] == ["Q1", "Q2", "Q3", "Q4"]
    for column in slices["columns"]:
        assert sum(s["num_samples"] for s in slices["by"][column].values()) == 90
    whole = datasets.load_dataset("csv", data_files=data, split="train")
    cells = [json.loads(line)["slice"] for line in open(out / "predictions.jsonl")]
    assert [cell["lang"] for cell in cells] == whole["lang"]
    for column, by_value in slices["by"].items():
        for value, got in by_value.items():
            rows = [i for i, cell in enumerate(cells) if cell[column] == value]
            alone = _evaluate(loaded, whole.select(rows)).metrics
            has_interval = got["num_samples"] >= MIN_INTERVAL_ROWS
            skipped = {"run", "num_truncated"} | (set() if has_interval else {"confidence_intervals"})
            for key, expected in alone.items():
                if key not in skipped:
                    assert_within_rounding(got.get(key), json.loads(json.dumps(expected)), f"{column}={value}: {key}",
                                           why=SLICE_ALONE)
            assert ("confidence_intervals" in got) == has_interval, (column, value)
            assert ("interval_note" in got) == (not has_interval)


def test_the_files_and_the_summary(sliced, capsys):
    _, _, out = sliced
    metrics = json.load(open(out / "metrics.json"))
    rows = list(csv.DictReader(open(out / "slices.csv")))
    assert len(rows) == 9
    accuracies = [float(r["accuracy"]) for r in rows]
    assert accuracies == sorted(accuracies)  # the worst first
    for r in rows:
        got = metrics["slices"]["by"][r["column"]][r["value"]]
        assert float(r["accuracy"]) == got["accuracy"] and int(r["rows"]) == got["num_samples"]
        assert (r["accuracy_low"] == "") == ("confidence_intervals" not in got)
    page = (out / "report.html").read_text()
    assert "<h2>Slices</h2>" in page and page.count("<svg ") == 9 and "too few rows for an interval" in page
    predictions = [json.loads(line) for line in open(out / "predictions.jsonl")]
    assert all(set(p["slice"]) == {"lang", "source", "token_length_quartile"} for p in predictions)
    from dist_eval.output.summary import format_summary

    summary = format_summary(metrics)
    assert "slices by lang, source, token_length_quartile (9, over 90 rows), lowest accuracy first:" in summary
    assert summary.count("rows\n") >= 5 and "    ... 4 more in slices.csv" in summary
    assert "too few rows for an interval" in summary or all(int(r["rows"]) >= MIN_INTERVAL_ROWS for r in rows)


def test_rescore_recomputes_every_slice(sliced, capsys):
    from dist_eval import rescore

    _, _, out = sliced
    assert rescore.main([str(out)]) == 0
    metrics = json.load(open(out / "metrics.json"))
    first = sorted(metrics["slices"]["by"]["lang"])[0]
    metrics["slices"]["by"]["lang"][first]["accuracy"] += 0.5
    broken = out.parent / "broken"
    broken.mkdir()
    (broken / "metrics.json").write_text(json.dumps(metrics))
    (broken / "predictions.jsonl").write_text((out / "predictions.jsonl").read_text())
    assert rescore.main([str(broken)]) == 1
    assert "slices" in capsys.readouterr().out


@pytest.mark.parametrize("flags, words", [
    (["--slice-by", "country"], "--slice-by country: no column 'country' in the data"),
    (["--slice-by", "text"], "distinct values, more than 100 slices"),
])
def test_bad_slice_columns_in_one_line(tiny_model, tiny_checkpoint, tmp_path, capsys, flags, words):
    data = write_sliced_csv(tmp_path / "data.csv", 120)
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files", data,
            "--output-dir", str(tmp_path / "out"), "--progress", "none", *flags]
    assert run_cli_in_process(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and words in err[0], err


def test_a_slice_of_one_row_is_said_in_one_line(tiny_model, tiny_checkpoint, tmp_path, capsys):
    data = write_sliced_csv(tmp_path / "data.csv", 20)
    with open(data, "a") as f:
        f.write("w1 w2,0,xx,s0\n")
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files", data,
            "--output-dir", str(tmp_path / "out"), "--progress", "none", "--slice-by", "lang"]
    assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
    captured = capsys.readouterr()
    said = [line for line in captured.err.splitlines() if "single row" in line]
    assert len(said) == 1 and "--slice-by: 1 slice(s) of a single row (lang=xx)" in said[0], captured.err
    assert "lang=xx: accuracy" in captured.out and "over 21 rows" in captured.out


def test_a_sampled_run_says_its_slices_are_over_the_rows_used(tiny_model, tiny_checkpoint, tmp_path, capsys):
    data = write_sliced_csv(tmp_path / "data.csv", 40)
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files", data,
            "--output-dir", str(tmp_path / "out"), "--progress", "none", "--slice-by", "source", "--limit", "25"]
    assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
    said = "slices by source, token_length_quartile (6, over the 25 rows of a random sample of 40)"
    assert said in capsys.readouterr().out
    metrics = json.load(open(tmp_path / "out" / "metrics.json"))
    assert sum(s["num_samples"] for s in metrics["slices"]["by"]["source"].values()) == 25


@pytest.mark.swarm
@pytest.mark.multiproc
def test_a_swarm_run_on_two_ranks_gives_the_same_slices(sliced, tiny_swarm, tiny_model, tiny_checkpoint, rank_zygote,
                                                        no_figures):
    """On a real swarm (petals, 2 ranks, forked by conftest's run_ranks): every slice's metrics are
    those of the local single-process run, bit for bit (the same batch plan: one row a batch). No figures
    drawn (matplotlib hidden): none is compared."""
    from conftest import run_ranks

    base, data, local = sliced
    out = base / "swarm"
    proc = run_ranks(rank_zygote, ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--data-files", data,
                                   "--output-dir", str(out), "--initial-peers", *tiny_swarm.initial_peers,
                                   "--dht-prefix", tiny_swarm.dht_prefix, "--slice-by", "lang", "source",
                                   "--bootstrap-resamples", "50", "--save-logits", "--batch-size", "1",
                                   "--progress", "none"], nproc=2, timeout=240, env=no_figures)
    assert proc.returncode == 0, proc.stderr[-3000:]
    swarm, single = (json.load(open(folder / "metrics.json")) for folder in (out, local))
    assert swarm["run"]["backend"] == "petals" and swarm["run"]["world_size"] == 2
    assert_same_bits(swarm["slices"], single["slices"], "the slices, petals on 2 ranks against local on 1")
    assert (out / "slices.csv").read_text() == (local / "slices.csv").read_text()


def test_slices_of_several_sets_and_of_a_run_that_stops_early(tiny_model, tiny_checkpoint, tmp_path, capsys):
    """Each pair's slices are of its own rows; a run that stops early: of the rows used (said)."""
    first, second = (write_sliced_csv(tmp_path / f"{name}.csv", rows, seed) for name, rows, seed in
                     (("a", 60, 1), ("b", 90, 2)))
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files",
            f"a={first}", f"b={second}", "--output-dir", str(tmp_path / "out"), "--progress", "none",
            "--slice-by", "lang", "--stop-at-width", "0.9", "--stop-round-rows", "20", "--bootstrap-resamples", "20"]
    assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
    said = capsys.readouterr().out
    for name, rows in (("a", 60), ("b", 90)):
        metrics = json.load(open(tmp_path / "out" / name / "metrics.json"))
        used = metrics["stopping"]["rows_used"]
        assert used < rows and metrics["slices"]["rows"] == used and metrics["slices"]["rows_in_set"] == rows
        assert sum(s["num_samples"] for s in metrics["slices"]["by"]["lang"].values()) == used
        assert f"slices by lang, token_length_quartile ({len(metrics['slices']['by']['lang']) + 4}, over the " \
               f"{used} rows used of {rows})" in said or f"over the {used} rows used of {rows})" in said
        predictions = [json.loads(line) for line in open(tmp_path / "out" / name / "predictions.jsonl")]
        assert len(predictions) == used and all("lang" in p["slice"] for p in predictions)


def test_holm_adjustment_by_hand():
    from dist_eval.paired import holm_adjusted

    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjusted([0.5, 0.9]) == [1.0, 1.0] and holm_adjusted([]) == []


def test_compare_per_slice_with_holm(sliced, capsys):
    """B = A with every lang=en row made right: of the lang slices only en differs after Holm's
    adjustment (the other columns' slices hold en rows: they may differ too)."""
    from dist_eval import compare

    base, _, out = sliced
    other = base / "better_en"
    other.mkdir(exist_ok=True)
    (other / "metrics.json").write_text((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in open(out / "predictions.jsonl")]
    for row in rows:
        if row["slice"]["lang"] == "en":
            row["pred"] = row["label"]
    (other / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert compare.main([str(out), str(other), "--json", str(base / "paired.json"), "--max-rows", "0"]) == 0
    said = capsys.readouterr().out
    assert "p adjusted by Holm for the 9 slices compared" in said
    assert "slices that differ (Holm-adjusted p < 0.05): lang=en (B better)" in said
    compared = json.load(open(base / "paired.json"))["slices"]
    assert compared["adjustment"] == "holm" and len(compared["slices"]) == 9
    by_name = {(r["column"], r["value"]): r for r in compared["slices"]}
    en = by_name[("lang", "en")]
    assert en["a_only"] == 0 and en["b_only"] == en["rows"] - round(en["accuracy_a"] * en["rows"])
    assert en["pvalue_holm"] == pytest.approx(min(1.0, 9 * en["pvalue"]))  # the smallest p: times 9
    assert [key for key, r in by_name.items() if r["differs"] and key[0] == "lang"] == [("lang", "en")]
    assert all(r["pvalue"] == 1.0 for key, r in by_name.items() if key[0] == "lang" and key[1] != "en")
    # a run over other data: refused in one line
    for row in rows:
        row["slice"]["lang"] = "zz"
    (other / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert compare.main([str(out), str(other)]) == 2
    assert "the slices of row 0 differ" in capsys.readouterr().err


def test_two_checkpoints_stopping_when_decided_then_compared_per_slice(tiny_model, tiny_checkpoint, tmp_path,
                                                                      capsys):
    """--stop-when-decided's two reports have the slices of the rows both used; compare pairs
    them per slice on those rows."""
    from conftest import build_checkpoint

    from dist_eval import compare

    other = build_checkpoint(str(tmp_path / "other.pt"), seed=7)
    data = write_sliced_csv(tmp_path / "data.csv", 80, seed=3)
    args = ["--model", tiny_model, "--checkpoint", f"A={tiny_checkpoint}", "--checkpoint", f"B={other}",
            "--backend", "local", "--data-files", data, "--output-dir", str(tmp_path / "out"), "--progress", "none",
            "--slice-by", "lang", "--stop-when-decided", "--stop-round-rows", "40", "--bootstrap-resamples", "0"]
    assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
    reports = [json.load(open(tmp_path / "out" / name / "metrics.json")) for name in "AB"]
    used = reports[0]["stopping"]["rows_used"]
    for metrics in reports:
        assert metrics["slices"]["rows"] == used and metrics["slices"]["rows_in_set"] == 80
        assert sum(s["num_samples"] for s in metrics["slices"]["by"]["lang"].values()) == used
        assert all("confidence_intervals" not in s for s in metrics["slices"]["by"]["lang"].values())
    capsys.readouterr()
    assert compare.main([str(tmp_path / "out" / "A"), str(tmp_path / "out" / "B"), "--max-rows", "0"]) == 0
    said = capsys.readouterr().out
    assert "per slice (paired, McNemar's exact test; p adjusted by Holm for the" in said
    assert f"paired test on the {used} shared rows" in said


def test_na_null_empty_and_missing_cells_are_slices_of_their_own():
    """Issue 50. Before: a missing cell was the slice "None" (as the text "None" was), and a CSV's "NA",
    "null", "n/a" and empty cells were read as missing: one slice, without a word."""
    import datasets

    from dist_eval.slices import EMPTY, MISSING, read_slice_values

    cells = ["NA", "null", "", None, "None", "n/a", "NA"]
    data = datasets.Dataset.from_dict({"region": cells, "n": [1, 2, None, 3, 3, 1, 2],
                                       "whole": [1.0, 2.0, None, 3.0, 3.0, 1.0, 2.0],
                                       "flag": [True, False] * 3 + [True]})
    values = read_slice_values(data, ["region", "n", "whole", "flag"])
    assert values["region"] == ["NA", "null", EMPTY, MISSING, "None", "n/a", "NA"]
    assert values["n"] == values["whole"] == ["1", "2", MISSING, "3", "3", "1", "2"]  # never "1.0", "nan"
    assert values["flag"][:2] == ["True", "False"]


@pytest.mark.parametrize("cells, words", [
    ([0.5, 1.0, 2.25], "column 'x' holds numbers that are no category (0.5 in row 0): a slice per float value"),
    ([1.0, float("nan")], "(nan in row 1)"),
    ([1.0, float("inf")], "(inf in row 1)"),
    (["a", "<missing>"], "column 'x' holds the text '<missing>' (row 1), the name of its slice of missing values"),
    (["<empty>", "b"], "the name of its slice of empty texts. Rename that text in the data."),
    ([[1], [2]], "column 'x' holds list values ([1] in row 0), not categories"),
])
def test_a_column_of_no_categories_is_refused_in_one_line(cells, words):
    import datasets

    from dist_eval.errors import UsageError
    from dist_eval.slices import read_slice_values

    with pytest.raises(UsageError) as caught:
        read_slice_values(datasets.Dataset.from_dict({"x": cells}), ["x"])
    assert caught.value.param == "slice_by" and words in str(caught.value) and "\n" not in str(caught.value)


def test_a_csv_keeps_its_na_texts_apart_from_its_empty_cells(tiny_model, tiny_checkpoint, tmp_path, capsys):
    """Issue 50: a region column's "NA" (North America), "null", "n/a" and empty cells are four slices;
    a float column is refused in one line naming the flag."""
    from dist_eval.slices import MISSING

    regions = ["NA", "", "null", "n/a"]
    data = tmp_path / "data.csv"
    data.write_text("text,label,region,score\n" + "".join(
        f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7) % len(WORDS)]},{i % 3},{regions[i % 4]},{i / 8}\n"
        for i in range(24)))
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files", str(data),
            "--output-dir", str(tmp_path / "out"), "--progress", "none", "--bootstrap-resamples", "0", "--slice-by"]
    assert run_cli_in_process([*args, "region"], hide_modules=NO_FIGURES) == 0
    by = json.load(open(tmp_path / "out" / "metrics.json"))["slices"]["by"]["region"]
    assert {name: s["num_samples"] for name, s in by.items()} == {"NA": 6, MISSING: 6, "null": 6, "n/a": 6}
    capsys.readouterr()
    assert run_cli_in_process([*args, "score"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--slice-by score: column 'score' holds numbers that are no category" in err[0], err


def test_csv_cells_a_spreadsheet_would_run_are_quoted(tiny_model, tiny_checkpoint, tmp_path):
    """Issue 50. Before: a class name or slice value starting with = + - @ was written as it is, and a
    spreadsheet opening per_class.csv or slices.csv ran it as a formula. Now it gets a leading single
    quote (OWASP); a number, a negative one too, stays a number."""
    labels = ["=HYPERLINK(\"http://x\")", "-2+3", "@SUM(A1)"]  # sorted: '-2+3' '=HYP...' '@SUM...'
    regions = ["+cmd", "-2", "plain"]
    data = tmp_path / "data.csv"
    with open(data, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label", "region"])
        for i in range(24):
            writer.writerow([f"{WORDS[i % len(WORDS)]} {WORDS[(i * 5) % len(WORDS)]}", labels[i % 3], regions[i % 3]])
    out = tmp_path / "out"
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files", str(data),
            "--output-dir", str(out), "--progress", "none", "--bootstrap-resamples", "0", "--slice-by", "region"]
    assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
    classes = [row["class"] for row in csv.DictReader(open(out / "per_class.csv"))]
    assert classes == ["'-2+3", "'=HYPERLINK(\"http://x\")", "'@SUM(A1)"]
    values = {row["value"] for row in csv.DictReader(open(out / "slices.csv")) if row["column"] == "region"}
    assert values == {"'+cmd", "-2", "plain"}
    for name in ("per_class.csv", "slices.csv"):  # no other cell starts a formula
        cells = [cell for row in csv.reader(open(out / name)) for cell in row]
        assert not [c for c in cells if c and (c[0] in "=+@" or (c[0] == "-" and not c[1:2].isdigit()))], name
