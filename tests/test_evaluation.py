"""Real gloo process groups (ranks forked by conftest's run_ranks: the launch is not what is tested
here): distributed == single process, exactly.

evaluate() is called inside a process group that the caller (a "training loop") made,
for dataset sizes 1, 2, 3, 5, 7, 100 and batch sizes 1, 4, 16, so that some ranks get
no batch at all and shards differ in size (worlds 2 and 3: a rank without a batch at sizes 1 and 2,
shards of unequal sizes at 5 and 7; a fourth rank added no case of its own, only a launch).
The same launches run the seeds' DataLoader cases
(gloo_loader_worker.py; test_data_loader.py tests dist_eval.data.loader in one process)."""
import json
import os

import numpy as np
import pytest
from conftest import REPO, run_ranks, write_csv
from float_promises import assert_same_bits, assert_within_rounding
from sklearn import metrics as skm

SIZES = (1, 2, 3, 5, 7, 100)
WORKER = os.path.join(REPO, "tests", "gloo_worker.py")


@pytest.fixture(scope="module")
def launches(tiny_model, tiny_checkpoint, tmp_path_factory, rank_zygote):
    """One launch per world size (1-3) runs both workers' cases: gloo_worker.py's and,
    with the same model, gloo_loader_worker.py's (worlds 1-3). World 1 is plain evaluate()
    without a process group: called in this process, with one thread as a torchrun rank has.
    Returns ({world: gloo_worker's folder}, {world: the loader cases' folder})."""
    import gloo_worker
    from inprocess_cli import one_thread

    base = tmp_path_factory.mktemp("gloo")
    csv = write_csv(str(base / "data.csv"), 100, seed=3)
    loader_csv = write_csv(str(base / "loader_data.csv"), 50, seed=5)
    out, loader_out = {}, {}
    for world in (1, 2, 3):
        out[world] = base / f"n{world}"
        out[world].mkdir()
        loader_out[world] = base / f"loader_n{world}"
        loader_out[world].mkdir()
        args = [tiny_model, tiny_checkpoint, csv, str(out[world]), loader_csv, str(loader_out[world])]
        if world == 1:
            with one_thread():
                gloo_worker.main(*args)
            continue
        proc = run_ranks(rank_zygote, args, nproc=world, script=WORKER)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out, loader_out


@pytest.fixture(scope="module")
def runs(launches):
    return launches[0]


@pytest.fixture(scope="module")
def loader_runs(launches):
    return launches[1]


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_metric_that_fails_in_a_run_that_stops_early_fails_every_rank_at_once(runs, world):
    """Rank 0's work in a run that stops early (the rounds' report, the stop metric's values) is done in
    phases, as a whole run's merge is: every rank raises a RankFailure naming it (before: rank 0 alone
    raised, and the others waited until the group's timeout, which the launch's 300 s would cut short here)."""
    with open(os.path.join(runs[world], "stopping_metric_fails.json")) as f:
        outcomes = json.load(f)
    assert len(outcomes) == world
    for outcome in outcomes:
        assert outcome.startswith("RankFailure: ") and (
            "reporting the rows used failed: ValueError: the user's metric broke" in outcome), outcome
    # rank 0's check of a sample metric to stop on, after a round: the usage error on every rank, at once
    with open(os.path.join(runs[world], "stop_metric_out_of_range.json")) as f:
        outcomes = json.load(f)
    found_by = "rank 0: " if world > 1 else ""  # on every rank, as rank 0 found it
    assert outcomes == [f"RankFailure: {found_by}stop_metric='twice': the sample metric's values must lie in [0, 1] "
                        "to stop on it; got values in [2.0, 2.0]. Rescale it to [0, 1]."] * world


def load(out_dir, name):
    arrays = dict(np.load(os.path.join(out_dir, name + ".npz")))
    with open(os.path.join(out_dir, name + ".json")) as f:
        return arrays, json.load(f)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_distributed_equals_single_process(runs, world, size, batch_size):
    name = f"dataset_{size}_{batch_size}"
    single, single_info = load(runs[1], name)
    multi, multi_info = load(runs[world], name)
    assert multi["indices"].tolist() == list(range(size))  # every row exactly once, in order
    assert np.array_equal(single["preds"], multi["preds"])
    assert_same_bits(multi["logits"], single["logits"], f"the logits, N={world} against 1")  # same batches whatever N
    assert_same_bits(multi_info["metrics"], single_info["metrics"], f"every metric, N={world} against 1")
    assert multi_info["same_on_all_ranks"]
    run = multi_info["run"]
    assert run["world_size"] == world and sum(run["per_rank_samples"]) == size
    num_batches = -(-size // batch_size)
    assert run["per_rank_samples"].count(0) == max(0, world - num_batches)  # empty ranks joined in


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("size", SIZES)
def test_metrics_equal_sklearn_on_the_merged_set(runs, world, size):
    arrays, info = load(runs[world], f"dataset_{size}_4")
    m = info["metrics"]
    labels, preds, logits = arrays["labels"], arrays["preds"], arrays["logits"]
    kw = dict(labels=[0, 1, 2], zero_division=0)
    assert m["num_samples"] == size
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(labels, preds), abs=1e-12)
    assert m["f1_macro"] == pytest.approx(skm.f1_score(labels, preds, average="macro", **kw), abs=1e-12)
    assert m["f1_weighted"] == pytest.approx(skm.f1_score(labels, preds, average="weighted", **kw), abs=1e-12)
    assert m["confusion_matrix"] == skm.confusion_matrix(labels, preds, labels=[0, 1, 2]).tolist()
    # user metrics: merged-set function and sample-weighted per-sample value
    assert m["num_predicted_0"] == int((preds == 0).sum())
    assert m["mean_max_logit"] == pytest.approx(float(logits.max(axis=1).mean()), rel=1e-6)
    margin = (logits[np.arange(size), labels] - logits.max(axis=1)).astype(np.float64)  # as the fn computes it
    assert m["correct_margin"] == pytest.approx(margin.mean(), rel=1e-9, abs=1e-12)
    import torch

    loss = torch.nn.functional.cross_entropy(torch.from_numpy(logits).double(), torch.from_numpy(labels)).item()
    assert m["loss"] == pytest.approx(loss, rel=1e-12)
    # the probability scores (issue 14), against scikit-learn and explicit formulas on the same rows
    probs = torch.softmax(torch.from_numpy(logits).double(), dim=1).numpy()
    assert m["top_k"] == 2
    assert m["top2_accuracy"] == pytest.approx(skm.top_k_accuracy_score(labels, probs, k=2, labels=[0, 1, 2]))
    onehot = np.eye(3)[labels]
    assert m["brier"] == pytest.approx(((probs - onehot) ** 2).sum(axis=1).mean(), rel=1e-12)
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
    edges = np.linspace(0, 1, 16)
    in_bin = [(confidence > lo) & (confidence <= hi) for lo, hi in zip(edges[:-1], edges[1:])]
    ece = sum(abs(correct[b].sum() - confidence[b].sum()) for b in in_bin) / size
    assert m["ece"] == pytest.approx(ece, rel=1e-9, abs=1e-12)
    assert sum(m["reliability"]["count"]) == size
    if len(set(labels.tolist())) == 3:
        assert m["auroc_macro"] == pytest.approx(skm.roc_auc_score(labels, probs, multi_class="ovr", average="macro"))
    intervals = m["confidence_intervals"]
    for name in ("ece", "brier", "top2_accuracy", "auroc_macro"):
        assert name in intervals


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("size", SIZES)
def test_dataloader_with_padding_sampler_counts_each_row_once(runs, world, size):
    single, single_info = load(runs[1], f"loader_{size}")
    multi, multi_info = load(runs[world], f"loader_{size}")
    assert multi["indices"].tolist() == list(range(size))
    assert np.array_equal(single["preds"], multi["preds"])
    assert multi_info["metrics"]["num_samples"] == size
    assert multi_info["metrics"]["confusion_matrix"] == single_info["metrics"]["confusion_matrix"]
    assert sum(multi_info["run"]["per_rank_samples"]) == size  # padded repeats masked before counting


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("variant", ["plain", "budget"])
def test_throughput_options_change_no_result(runs, world, size, variant):
    """Length buckets, a token budget and batches in flight give the same predictions and
    metrics as the plain loop (dataset order, one batch at a time), for any N."""
    reference, reference_info = load(runs[1], f"plain_{size}")
    other, other_info = load(runs[world], f"{variant}_{size}")
    default, default_info = load(runs[world], f"dataset_{size}_4")
    for arrays, info in ((other, other_info), (default, default_info)):
        assert arrays["indices"].tolist() == list(range(size))
        assert np.array_equal(arrays["preds"], reference["preds"])
        assert_within_rounding(arrays["logits"], reference["logits"], "the logits, against the plain loop's",
                               why="batches of other rows and other padded lengths")
        # everything computed from (labels, preds) is exactly equal; what uses the logits
        # (loss, its interval, user metrics of logits) to float32 rounding
        scores = ("ece", "brier", "top2_accuracy", "auroc_macro")  # of the probabilities (issue 14)
        from_logits = ("loss", "mean_max_logit", "correct_margin", "confidence_intervals", "reliability", *scores)
        common = (set(info["metrics"]) & set(reference_info["metrics"])) - set(
            from_logits
        )  # user metrics: only some runs
        assert len(common) > 15
        assert {k: info["metrics"][k] for k in common} == {k: reference_info["metrics"][k] for k in common}
        got, want = info["metrics"]["confidence_intervals"], reference_info["metrics"]["confidence_intervals"]
        close = ("loss", *scores)
        assert {k: v for k, v in got.items() if k not in close} == {k: v for k, v in want.items() if k not in close}
        # None: undefined (AUROC with one class present) in both
        assert_within_rounding([{name: info["metrics"][name] for name in close}, {name: got[name] for name in close}],
                               [{name: reference_info["metrics"][name] for name in close},
                                {name: want[name] for name in close}],
                               "the loss and scores and their intervals, against the plain loop's",
                               why="batches of other rows and other padded lengths")
    # and each option is still exact across N: bitwise equal to its own single-process run
    single, _ = load(runs[1], f"{variant}_{size}")
    assert_same_bits(other["logits"], single["logits"], f"the logits of {variant}, N={world} against 1")


# the seeds' DataLoader (dist_eval.data.loader) in real gloo groups (moved here from
# test_data_loader.py: its cases run in this module's launches). A DistributedSampler needs a
# process group: one process runs the plain loaders only
WORLD_CASES = [(world, case) for world in (1, 2, 3)
               for case in ("dist_shuffle0", "dist_shuffle1", "plain_shuffle0", "plain_shuffle1")
               if world > 1 or case.startswith("plain")]


@pytest.mark.multiproc
@pytest.mark.parametrize("size", [1, 5, 7, 50])
@pytest.mark.parametrize(("world", "case"), WORLD_CASES)
def test_seeds_loader_every_row_once_metrics_equal_sklearn(loader_runs, world, size, case):
    single, _ = load(loader_runs[1], f"plain_shuffle0_{size}")
    arrays, m = load(loader_runs[world], f"{case}_{size}")
    assert arrays["indices"].tolist() == list(range(size))  # every row once; repeats dropped
    assert m["num_samples"] == size and sum(m["run"]["per_rank_samples"]) == size
    assert np.array_equal(arrays["preds"], single["preds"]) and np.array_equal(arrays["labels"], single["labels"])
    uncut = np.load(os.path.join(loader_runs[1], f"uncut_{size}.npy"))  # cut batches: the same results
    assert_within_rounding(arrays["logits"], uncut, f"the logits of {case}, N={world}, against uncut batches'",
                           why="the caller's loader cuts other batches (other rows, other padded lengths)")
    assert np.array_equal(arrays["preds"], uncut.argmax(1))
    labels, preds = single["labels"], single["preds"]
    kw = dict(labels=[0, 1, 2], zero_division=0)
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(labels, preds), abs=1e-12)
    assert m["f1_macro"] == pytest.approx(skm.f1_score(labels, preds, average="macro", **kw), abs=1e-12)
    assert m["confusion_matrix"] == skm.confusion_matrix(labels, preds, labels=[0, 1, 2]).tolist()


def test_a_class_count_beyond_the_bound_is_refused_before_any_forward():
    """Issue 50. Before: 20,000 classes failed after every forward was done, building a 3.2 GB
    confusion matrix on rank 0. Now refused in one line before the first forward."""
    import torch

    from dist_eval import evaluate
    from dist_eval.evaluation import MAX_CLASSES
    from dist_eval.ranks.phases import RankFailure

    forwards = []

    def model(input_ids):
        forwards.append(len(input_ids))
        return torch.zeros(len(input_ids), MAX_CLASSES + 1)

    rows = [{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor(0)} for _ in range(4)]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    # refused in the phase that prepares the data (every rank alike: one failure, one line)
    with pytest.raises(RankFailure, match=rf"num_labels={MAX_CLASSES + 1}: expected at most {MAX_CLASSES} classes"):
        evaluate(model, loader, num_labels=MAX_CLASSES + 1, pad_token_id=0)
    assert forwards == []
    assert f"more than {MAX_CLASSES} classes" in open(os.path.join(REPO, "docs", "running.md")).read()
