"""--cluster-by (issue 52): the cluster bootstrap and the cluster-robust standard error.

Checked against statsmodels' CR1 standard error, against a plain cluster bootstrap written
here row by row, in a coverage simulation, and end to end through the CLI and rescore.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import WORDS
from float_promises import assert_same_bits
from inprocess_cli import one_thread, run_cli_in_process

from dist_eval import metrics as M
from dist_eval.clusters import (
    CLUSTER_STREAM,
    cluster_bootstrap_intervals,
    cluster_numbers,
    cr1_standard_error,
    design_effect,
    iid_standard_error,
    paired_cluster_bootstrap,
)
from dist_eval.errors import UsageError


def clustered_rows(seed: int, clusters: int = 30, classes: int = 3):
    """Rows in clusters of 1 to 12 rows whose correctness is correlated within a cluster."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 13, clusters)
    cluster = np.repeat(np.arange(clusters), sizes)
    n = cluster.size
    right = rng.random(n) < rng.beta(2, 2, clusters)[cluster]
    labels = rng.integers(0, classes, n)
    preds = np.where(right, labels, (labels + rng.integers(1, classes, n)) % classes)
    probs = M.softmax(rng.normal(size=(n, classes)) + 2 * np.eye(classes)[preds])
    return cluster, labels, preds, rng.random(n), probs


@pytest.mark.parametrize("seed", [0, 1])
def test_clustered_standard_errors_equal_statsmodels_cr1(seed):
    sm = pytest.importorskip("statsmodels.regression.linear_model")
    cluster, labels, preds, _, _ = clustered_rows(seed)
    other = np.random.default_rng(seed + 10).integers(0, 3, labels.size)
    ones = np.ones(labels.size)
    for values in ((preds == labels).astype(float), (other == labels).astype(float) - (preds == labels)):
        fit = sm.OLS(values, ones).fit(cov_type="cluster", cov_kwds={"groups": cluster})
        assert abs(cr1_standard_error(values, cluster) - fit.bse[0]) < 1e-9
        assert abs(iid_standard_error(values) - sm.OLS(values, ones).fit().bse[0]) < 1e-9
        assert abs(design_effect(values, cluster) - (fit.bse[0] / sm.OLS(values, ones).fit().bse[0]) ** 2) < 1e-9
    losses = np.random.default_rng(seed + 20).random((2, labels.size))
    paired = paired_cluster_bootstrap(labels, preds, other, *losses, cluster, 3, resamples=0)
    for name, difference in (("accuracy", (other == labels).astype(float) - (preds == labels)),
                             ("loss", losses[1] - losses[0])):
        fit = sm.OLS(difference, ones).fit(cov_type="cluster", cov_kwds={"groups": cluster}, use_t=True)
        assert abs(paired[name]["standard_error_clustered"] - fit.bse[0]) < 1e-9
        assert abs(paired[name]["pvalue_clustered"] - fit.pvalues[0]) < 1e-9  # t on G - 1 df


def _plain_cluster_bootstrap(cluster, labels, preds, losses, probs, resamples, seed, num_labels, k=2):
    """The cluster bootstrap as written in a textbook: draw G cluster ids with replacement (the
    same random stream as dist_eval's), gather their rows, compute each metric on them."""
    names = cluster_numbers([f"c{c}" for c in cluster])
    g = names.max() + 1
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(CLUSTER_STREAM,))))
    drawn = rng.integers(0, g, size=(resamples, g), dtype=np.int32)
    values = {name: [] for name in ("accuracy", "f1_macro", "loss", "ece", "brier", "top2_accuracy", "auroc_macro")}
    for ids in drawn:
        rows = np.concatenate([np.flatnonzero(names == i) for i in ids])
        scores = M.metrics_from_confusion(M.confusion_matrix(labels[rows], preds[rows], num_labels))
        values["accuracy"].append(scores["accuracy"])
        values["f1_macro"].append(scores["f1_macro"])
        values["loss"].append(losses[rows].mean())
        for name, value in M.score_metrics(probs[rows], labels[rows], k).items():
            values[name].append(value)
    return {name: np.percentile(v, [2.5, 97.5]).tolist() for name, v in values.items()}


def test_the_cluster_bootstrap_is_a_plain_cluster_bootstrap_in_any_row_order():
    cluster, labels, preds, losses, probs = clustered_rows(2, clusters=12)
    preds = np.where(preds == 2, 1, preds)  # a class never predicted, and a 4th class absent: their F1 is 0
    names = np.array([f"c{c}" for c in cluster])
    got = cluster_bootstrap_intervals(labels, preds, losses, cluster_numbers(names), 4, 60, 7, probs=probs)
    want = _plain_cluster_bootstrap(cluster, labels, preds, losses, probs, 60, 7, num_labels=4)
    for name, interval in want.items():
        assert got[name] == pytest.approx(interval, abs=1e-12), name
    assert got["clusters"] == 12 and got["method"] == "cluster-bootstrap-percentile"
    order = np.random.default_rng(0).permutation(labels.size)
    shuffled = cluster_bootstrap_intervals(labels[order], preds[order], losses[order], cluster_numbers(names[order]),
                                           4, 60, 7, probs=probs[order])
    assert shuffled == got  # bit for bit: the clusters by name, the rows in a canonical order


def test_the_paired_cluster_bootstrap_is_a_plain_one_in_any_row_order():
    """B - A in accuracy, macro F1 and loss: each resample draws G cluster ids (the same for A and B),
    gathers their rows and scores both models on them, as a textbook would; macro F1's clustered
    p-value is the draws' two-sided share beyond 0."""
    from dist_eval.clusters import PAIRED_CLUSTER_STREAM

    cluster, labels, preds_a, losses_a, _ = clustered_rows(5, clusters=12)
    preds_b = np.where(np.random.default_rng(5).random(labels.size) < 0.3, labels, preds_a)
    losses_b = np.random.default_rng(6).random(labels.size)
    names = np.array([f"c{c}" for c in cluster])
    got = paired_cluster_bootstrap(labels, preds_a, preds_b, losses_a, losses_b, cluster_numbers(names), 3, 60, 7)
    numbers = cluster_numbers(names)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(7, spawn_key=(PAIRED_CLUSTER_STREAM,))))
    draws = {"accuracy": [], "f1_macro": [], "loss": []}
    for ids in rng.integers(0, 12, size=(60, 12), dtype=np.int32):
        rows = np.concatenate([np.flatnonzero(numbers == i) for i in ids])
        a, b = (M.metrics_from_confusion(M.confusion_matrix(labels[rows], p[rows], 3)) for p in (preds_a, preds_b))
        draws["accuracy"].append(b["accuracy"] - a["accuracy"])
        draws["f1_macro"].append(b["f1_macro"] - a["f1_macro"])
        draws["loss"].append(losses_b[rows].mean() - losses_a[rows].mean())
    for name, drawn in draws.items():
        assert got[name]["interval"] == pytest.approx(np.percentile(drawn, [2.5, 97.5]).tolist(), abs=1e-12), name
    f1 = np.array(draws["f1_macro"])
    assert got["f1_macro"]["pvalue_clustered"] == min(1.0, 2 * min((f1 <= 0).mean(), (f1 >= 0).mean()))
    order = np.random.default_rng(0).permutation(labels.size)
    shuffled = paired_cluster_bootstrap(labels[order], preds_a[order], preds_b[order], losses_a[order],
                                        losses_b[order], cluster_numbers(names[order]), 3, 60, 7)
    assert shuffled == got  # bit for bit


def test_the_cluster_bootstrap_covers_at_its_level_and_the_row_bootstrap_does_not():
    """2,000 sets of 40 clusters of 8 rows, intra-cluster correlation 0.1 to 0.5 (cluster accuracies
    drawn from a beta of mean 0.7): the 95% interval of the accuracy drawn by clusters covers 0.7 in
    about 95% of the sets, drawn by rows (each row a cluster of its own) in far fewer."""
    runs, g, m, p = 2000, 40, 8, 0.7
    rng = np.random.default_rng(1)
    icc = np.linspace(0.1, 0.5, runs)[:, None]
    right = rng.random((runs, g, m)) < rng.beta(p * (1 / icc - 1), (1 - p) * (1 / icc - 1), (runs, g))[:, :, None]
    labels, losses = np.zeros(g * m, dtype=np.int64), np.zeros(g * m)
    by_cluster, by_row = np.repeat(np.arange(g), m), np.arange(g * m)
    covered = np.zeros((2, runs), dtype=bool)
    for run in range(runs):
        preds = (~right[run].ravel()).astype(np.int64)
        for arm, clusters in enumerate((by_cluster, by_row)):
            low, high = cluster_bootstrap_intervals(labels, preds, losses, clusters, 2, 100, run)["accuracy"]
            covered[arm, run] = low <= p <= high
    clustered, rows = covered.mean(axis=1)
    assert 0.92 <= clustered <= 0.97, clustered  # 0.925 (figures: docs/statistics.md)
    assert rows < 0.80, rows  # 0.72


def test_stopping_rules_and_bad_cluster_columns_are_refused_in_one_line(tmp_path, capsys):
    import datasets

    from dist_eval.config import settings_from
    from dist_eval.slices import read_cluster_names

    with pytest.raises(UsageError, match="cluster_by='doc': the stopping rules take rows as independent.*stop_at"):
        settings_from({"cluster_by": "doc", "stop_at_width": 0.1})
    for rule in (["--stop-at-width", "0.1"], ["--stop-when-decided"]):  # the CLI: exit 2, one line, before any work
        assert run_cli_in_process(["--cluster-by", "doc", *rule, "--output-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dist_eval: error: --cluster-by doc: the stopping rules take rows as independent") \
            and "\n" not in err, err
    data = datasets.Dataset.from_dict({"doc": ["a", "a", None], "one": ["x", "x", "x"], "text": ["t", "u", "v"]})
    for column, words in (("doc", "row 2 has no value"), ("one", "one value"), ("nope", "no column 'nope'")):
        with pytest.raises(UsageError, match=words) as caught:
            read_cluster_names(data, column)
        assert str(caught.value).startswith(f"cluster_by={column!r}: ") and "\n" not in str(caught.value)


def _csv(path, rows: int = 60) -> str:
    r = random.Random(0)
    with open(path, "w") as f:
        f.write("text,label,doc,lang\n")
        for i in range(rows):
            doc = i // 5
            f.write(f"{' '.join(r.choice(WORDS) for _ in range(4))} w{doc},{(doc + i % 2) % 3},d{doc},"
                    f"{'en' if i % 3 else 'de'}\n")
    return str(path)


def test_a_clustered_run_end_to_end(tiny_model, tiny_checkpoint, tmp_path, capsys):
    """The CLI: every interval clustered (the set's, a slice's), the row bootstrap's beside them
    (rescore recomputes both: the row bootstrap's are row_metrics', as without --cluster-by), each
    row's cluster in predictions.jsonl."""
    from dist_eval import rescore

    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--data-files",
            _csv(tmp_path / "data.csv"), "--bootstrap-resamples", "100", "--progress", "none", "--save-logits",
            "--slice-by", "lang", "--output-dir", str(tmp_path / "out"), "--cluster-by", "doc"]
    assert run_cli_in_process(args) == 0
    summary = capsys.readouterr().out
    assert "95% CI (cluster bootstrap of 12 clusters" in summary
    assert "clusters by doc: 12 clusters of 60 rows" in summary
    report = json.load(open(tmp_path / "out" / "metrics.json"))
    clustered, rows = report["confidence_intervals"], report["clustering"]["unclustered_intervals"]
    assert clustered["method"] == "cluster-bootstrap-percentile" and rows["method"] == "bootstrap-percentile"
    assert set(clustered) - {"clusters"} == set(rows) and clustered["auroc_macro"] != rows["auroc_macro"]
    assert report["slices"]["by"]["lang"]["en"]["confidence_intervals"]["clusters"] == 12
    assert "Whole clusters resampled: 12 clusters of column doc" in open(tmp_path / "out" / "report.html").read()
    written = [json.loads(line) for line in open(tmp_path / "out" / "predictions.jsonl")]
    assert [row["cluster"] for row in written[:6]] == ["d0"] * 5 + ["d1"]
    assert rescore.main([str(tmp_path / "out")]) == 0
    assert "all 23 recomputed metrics equal metrics.json" in capsys.readouterr().out
    import datasets
    from transformers import AutoTokenizer

    from dist_eval import evaluate, load_model

    with one_thread():  # the API's cluster_by=: the CLI's clustered intervals and clustering, bit for bit
        result = evaluate(load_model("local", tiny_model, checkpoint=tiny_checkpoint),
                          datasets.load_dataset("csv", data_files=str(tmp_path / "data.csv"), split="train"),
                          tokenizer=AutoTokenizer.from_pretrained(tiny_model), cluster_by="doc",
                          bootstrap_resamples=100)
    api = result.metrics
    assert result.predictions.logits is None  # kept for the clustered intervals, not returned unasked
    assert_same_bits({k: api[k] for k in ("confidence_intervals", "clustering")},
                     {k: report[k] for k in ("confidence_intervals", "clustering")}, "the API's against the CLI's")


def test_compare_draws_the_clusters_of_two_clustered_runs():
    """compare on two runs with the same clusters: the paired interval resamples clusters (the row
    bootstrap's beside it), the design effect of the difference is CR1's, the power counts it; per
    slice, each slice's interval of B - A is the paired cluster bootstrap of its rows alone (the row
    bootstrap's beside it), Holm adjusts the cluster-robust p-values; runs clustered otherwise are
    refused in one line."""
    from dist_eval.compare import RunOutputs, compare_runs, format_comparison
    from dist_eval.paired import holm_adjusted, paired_bootstrap

    cluster, labels, preds, losses, _ = clustered_rows(3)
    other = np.where(np.random.default_rng(3).random(labels.size) < 0.3, (preds + 1) % 3, preds)
    names = [f"c{c}" for c in cluster]
    n = labels.size
    cells = [{"lang": "de" if i % 3 == 0 else "en"} for i in range(n)]
    metrics = {"num_samples": n, "num_labels": 3, "accuracy": 0.0}
    a = RunOutputs("A", metrics, np.arange(n), labels, preds, losses, slices=cells, clusters=names)
    b = RunOutputs("B", metrics, np.arange(n), labels, other, losses, slices=cells, clusters=names)
    compared = compare_runs(a, b, resamples=200)
    paired = compared.paired
    boot = paired["bootstrap"]
    assert boot["method"] == "cluster-bootstrap-percentile" and boot["clusters"] == 30
    assert paired["bootstrap_rows"]["method"] == "bootstrap-percentile"
    difference = (other == labels).astype(float) - (preds == labels)
    assert boot["accuracy"]["design_effect"] == design_effect(difference, cluster_numbers(names))
    assert paired["power"].get("design_effect", 1.0) == max(1.0, boot["accuracy"]["design_effect"])
    said = format_comparison(compared)
    assert "(rows as independent: [" in said
    assert "cluster-robust tests of macro F1 (the cluster bootstrap's) p < 0.01, of loss (CR1 t) p = 1" in said
    sliced = paired["slices"]
    assert sliced["test"].startswith("cluster-robust t (CR1") and len(sliced["slices"]) == 2
    for row in sliced["slices"]:
        mask = np.array([cell["lang"] == row["value"] for cell in cells])
        alone = (labels[mask], preds[mask], other[mask], losses[mask], losses[mask])
        clustered = paired_cluster_bootstrap(*alone, cluster_numbers(np.array(names)[mask]), 3, 200)["accuracy"]
        assert row["interval"] == clustered["interval"] and row["pvalue_clustered"] == clustered["pvalue_clustered"]
        assert row["interval_rows"] == paired_bootstrap(*alone, 3, 200)["accuracy"]["interval"] != row["interval"]
        assert row["clusters"] == len(set(np.array(names)[mask]))
    assert [row["pvalue_holm"] for row in sliced["slices"]] == holm_adjusted(
        [row["pvalue_clustered"] for row in sliced["slices"]])
    assert "per slice (paired, the cluster-robust test (CR1); p adjusted by Holm for the 2 slices" in said
    assert "CI, rows as indep." in said
    from dist_eval.compare import compare_many

    compared_many = compare_many([a, b, a], resamples=0)
    many = compared_many["pairs"][0]  # several clustered runs: the clusters counted
    assert many["test"] == "cluster-robust t (CR1)" and many["pvalue"] == boot["accuracy"]["pvalue_clustered"]
    assert compared_many["test"].startswith("cluster-robust t (CR1"), compared_many["test"]  # was "McNemar exact"
    same = compare_runs(a, a, resamples=50)  # no discordant row: the design effect is undefined, said so
    assert same.paired["bootstrap"]["accuracy"]["design_effect"] is None
    assert "design effect of the difference undefined" in format_comparison(same)
    json.dumps(same.paired, allow_nan=False)
    with pytest.raises(UsageError, match="the clusters of row 0 differ"):
        compare_runs(a, RunOutputs("B", metrics, np.arange(n), labels, other, losses, clusters=["x"] * n))


def test_clusters_alike_in_their_difference_leave_it_to_mcnemars_test():
    """B fixes one row in each of G equal clusters and changes nothing else: every cluster's mean difference is the
    same, the CR1 variance is zero but for rounding, and its t test said p ~ 1e-17 ("differs", Holm too) of two
    rows, where McNemar's exact test says 0.5. No spread between the clusters: no cluster-robust p-value, and
    compare uses McNemar's (exact: 0.5, 0.0625)."""
    from dist_eval.clusters import cluster_robust_pvalue
    from dist_eval.compare import RunOutputs, compare_many, compare_runs, format_comparison

    for g, size in ((2, 10), (5, 20)):
        n = g * size
        names = [f"c{i // size}" for i in range(n)]
        labels, preds_a = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        preds_a[::size] = 1  # one wrong row in each cluster, which B gets right
        difference = (labels == labels).astype(float) - (preds_a == labels)
        assert np.isnan(cluster_robust_pvalue(difference, cluster_numbers(names)))
        metrics = {"num_samples": n, "num_labels": 2, "accuracy": 0.0}
        losses = np.zeros(n)
        runs = [RunOutputs(name, metrics, np.arange(n), labels, preds, losses, clusters=names)
                for name, preds in (("A", preds_a), ("B", labels))]
        pair = compare_many(runs, resamples=0)["pairs"][0]
        assert pair["test"] == "McNemar exact" and pair["pvalue"] == 0.5 ** (g - 1) and not pair["differs"], pair
        said = format_comparison(compare_runs(*runs, resamples=50))  # said, the loss's and F1's tests kept
        assert "cluster-robust test of accuracy: none (every cluster holds the same difference" in said, said
        assert "cluster-robust tests of macro F1 (the cluster bootstrap's)" in said, said
    spread = np.array([1.0, 1, 1, 0, 0, 0, 0, 0, 0, 1])  # clusters that differ: the t test as ever
    assert 0 < cluster_robust_pvalue(spread, cluster_numbers([f"c{i // 5}" for i in range(10)])) < 1


def test_the_worked_example_of_the_docs_prints_what_the_docs_say(capsys):
    """docs/statistics.md's worked example runs and prints the figures written under it."""
    import os
    import re

    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "statistics.md")).read()
    section = page.split("## A worked example\n", 1)[1].split("\n## ", 1)[0]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)
    exec(compile(code, "docs/statistics.md", "exec"), {})
    assert capsys.readouterr().out == printed


def test_a_big_sets_clustered_auroc_is_linearized_close_to_the_exact_one(monkeypatch):
    """Above EXACT_AUROC_ROWS rows a resample's AUROC is the set's plus its drawn clusters' influence
    (cost: clusters, not rows x classes), close to the exact resample's, and named in the method."""
    import dist_eval.clusters as C

    rng = np.random.default_rng(4)
    n, g = 4000, 400
    cluster = rng.integers(0, g, n)
    labels = rng.integers(0, 3, n)
    probs = M.softmax(rng.normal(size=(n, 3)) + 1.5 * np.eye(3)[labels] * rng.random((n, 1)))
    preds, losses = probs.argmax(axis=1), rng.random(n)
    exact = cluster_bootstrap_intervals(labels, preds, losses, cluster, 3, 300, 1, probs=probs)
    monkeypatch.setattr(C, "EXACT_AUROC_ROWS", 1000)
    linear = cluster_bootstrap_intervals(labels, preds, losses, cluster, 3, 300, 1, probs=probs)
    assert linear["method"] == "cluster-bootstrap-percentile; AUROC linearized" != exact["method"]
    assert linear["auroc_macro"] == pytest.approx(exact["auroc_macro"], abs=0.001)  # 3e-4 apart
    assert {k: v for k, v in linear.items() if k not in ("auroc_macro", "method")} == \
        {k: v for k, v in exact.items() if k not in ("auroc_macro", "method")}


def _paired_clustered_sets(runs, g, m, effect, discordance, spread, seed):
    """``runs`` paired sets of g clusters of m rows: B - A per row (+1, -1, 0), the share of B-only
    and A-only rows of each cluster shifted by a cluster effect uniform in +-spread."""
    rng = np.random.default_rng(seed)
    shift = rng.uniform(-spread, spread, (runs, g))
    b_only, a_only = (discordance + effect + shift) / 2, (discordance - effect - shift) / 2
    draw = rng.random((runs, g, m))
    d = np.where(draw < b_only[:, :, None], 1.0, np.where(draw < (b_only + a_only)[:, :, None], -1.0, 0.0))
    return d.reshape(runs, g * m), np.repeat(np.arange(g), m)


def test_clustered_comparisons_keep_their_level_and_the_rows_the_design_effect_asks_for_their_power():
    """Paired sets of clusters of 20 rows (design effect of the difference about 2.1), 2,000 each:
    with no difference McNemar's test rejects 16.6% of the time at 0.05, the cluster-robust test
    4.9%; with a difference of 0.05 (20% discordant), rows_for_effect with the design effect (1,411)
    give the cluster-robust test 80.9% power, the rows without it (665) 47.6%."""
    from scipy.stats import binom

    from dist_eval.clusters import cluster_robust_pvalue
    from dist_eval.power import rows_for_effect

    def rejections(d, cluster):
        b_only, a_only = (d == 1).sum(axis=1), (d == -1).sum(axis=1)
        mcnemar = np.minimum(1.0, 2 * binom.cdf(np.minimum(a_only, b_only), a_only + b_only, 0.5))
        clustered = np.array([cluster_robust_pvalue(row, cluster) for row in d])
        return (mcnemar < 0.05).mean(), (clustered < 0.05).mean()

    mcnemar, clustered = rejections(*_paired_clustered_sets(2000, 40, 20, 0.0, 0.2, 0.19, 0))
    assert mcnemar > 0.12 and 0.035 <= clustered <= 0.065, (mcnemar, clustered)
    pilot, cluster = _paired_clustered_sets(200, 200, 20, 0.05, 0.2, 0.19, 1)
    deff = float(np.mean([design_effect(row, cluster) for row in pilot]))
    assert 1.9 < deff < 2.4, deff
    power = {}
    for rows in (rows_for_effect(0.05, 0.2, design_effect=deff), rows_for_effect(0.05, 0.2)):
        power[rows] = rejections(*_paired_clustered_sets(2000, -(-rows // 20), 20, 0.05, 0.2, 0.19, 2))[1]
    enough, too_few = power.values()
    assert 0.77 <= enough <= 0.85 and too_few < 0.6, power
