"""The docs cannot drift from the code (issue 24): docs/cli.md is the page generated from the
parsers; every ``--flag`` written in a Markdown file exists in the command it is written
for; docs/outputs.md lists exactly the keys a real run writes; the Python snippets of
docs/python-api.md (and the README's) run; docs/contributing.md lists every test file and
every module."""
import contextlib
import glob
import json
import os
import re

import pytest
from conftest import REPO, WORDS
from docs_flags import FOREIGN, command_flags, markdown_files, unknown_flags
from inprocess_cli import one_thread, run_cli_in_process

DOCS = os.path.join(REPO, "docs")


def read(*path: str) -> str:
    with open(os.path.join(REPO, *path)) as f:
        return f.read()


def test_cli_page_is_the_one_generated_from_the_parsers():
    from dist_eval.docs_cli import markdown

    assert read("docs", "cli.md") == markdown(), (
        "docs/cli.md differs from the parsers' flags: run `python -m dist_eval.docs_cli > docs/cli.md` and commit it")


def test_the_cli_page_covers_every_command_and_every_flag():
    from dist_eval.docs_cli import commands

    page = read("docs", "cli.md")
    for name, (_, build) in commands().items():
        assert f"## `{name}`" in page, name
        for action in build()._actions:
            for option in action.option_strings:
                assert option in ("-h", "--help") or f"`{option}" in page, (name, option)
    assert "## `dist-eval`" in page


def test_every_flag_written_in_the_docs_exists_in_its_command():
    bad = unknown_flags(markdown_files(), command_flags())
    assert not bad, "flags that their command does not have:\n" + "\n".join(bad)


def test_the_flag_check_fails_on_a_flag_given_to_the_wrong_command(tmp_path):
    """The checker itself: the issue's examples (--torch-dtype given to a run; a swarm flag
    after torchrun), a made-up flag, and the right commands passing."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Serving\n\n"
        "`--local-servers K` and `--torch-dtype` override the defaults.\n\n"
        "# Commands\n\n```bash\ntorchrun --nproc_per_node=2 -m dist_eval --model M --block-indices 0:2\n"
        "python -m dist_eval.swarm M --torch-dtype float16 --servers 2\n"
        "dist-eval --nproc-per-node 2 -- --data-files x.csv --no-such-flag\n```\n\n"
        "`python -m dist_eval.swarm --torch-dtype` picks the dtype; petals' `--max_batch_size` is its own.\n")
    bad = unknown_flags([str(page)], command_flags())
    assert [line.split(": ")[1].split(" ")[0] for line in bad] == ["--torch-dtype", "--block-indices",
                                                                   "--no-such-flag"], bad
    assert "--max_batch_size" in FOREIGN["petals server"]


# -- docs/outputs.md against a real run ----------------------------------------------------

# dicts whose keys are fixed names, documented one by one as `a.b`; any other dict (class
# ids, phase names, package names, the intervals by metric) is documented as one key
DESCEND = ("run", "reliability", "run.sample", "run.pair", "run.row_store")
# documented keys a small local run cannot write
ONLY_ELSEWHERE = {"run.swarm": "the petals backend (tests/test_backends_petals.py)",
                  "run.swarm.audit": "a petals run with --audit (tests/test_audit.py)",
                  "run.swarm.rope_left_out": "a swarm with a server of other RoPE (tests/test_backends_petals.py)",
                  "run.pair.compared_with_run_key": "a run of --stop-when-decided (tests/test_stopping.py)"}
TOP_K = re.compile(r"top\d+_accuracy")


def flatten(record: dict, prefix: str = "") -> set:
    keys = set()
    for key, value in record.items():
        name = "top{K}_accuracy" if TOP_K.fullmatch(key) else prefix + key
        keys.add(name)
        if prefix + key in DESCEND and isinstance(value, dict):
            keys |= flatten(value, prefix + key + ".")
    return keys


def documented_keys(heading: str) -> set:
    """The keys in the first column of the tables under ``heading`` in docs/outputs.md."""
    page = read("docs", "outputs.md")
    section = page.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {key for cell in first_cells for key in re.findall(r"`([^`]+)`", cell)}


@pytest.fixture(scope="module")
def small_run(tiny_model, tiny_checkpoint, tmp_path_factory):
    """Two named sets (so each report has run.pair), text labels (class names), a text pair,
    logits and texts saved, a --limit sample: every conditional key but the swarm's."""
    base = tmp_path_factory.mktemp("docs_outputs")
    for name, rows in (("dev", 14), ("test", 11)):
        with open(base / f"{name}.csv", "w") as f:
            f.write("text,text_pair,label\n")
            for i in range(rows):
                f.write(f"{WORDS[i]} {WORDS[i + 3]},{WORDS[2 * i]},{('cat', 'dog', 'emu')[i % 3]}\n")
    args = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local",
            "--data-files", f"dev={base / 'dev.csv'}", f"test={base / 'test.csv'}", "--text-pair-column",
            "text_pair", "--output-dir", str(base / "out"), "--save-logits", "--save-text", "--limit", "10",
            "--bootstrap-resamples", "20", "--progress", "none", "--quiet", "--slice-by", "label",
            "--cluster-by", "text_pair"]
    assert run_cli_in_process(args) == 0
    return base / "out"


def test_outputs_page_lists_exactly_the_metrics_json_keys(small_run):
    written = set()
    for path in glob.glob(str(small_run / "*" / "metrics.json")):
        written |= flatten(json.load(open(path)))
    documented = documented_keys("## `metrics.json`")
    assert set(ONLY_ELSEWHERE) <= documented
    assert not written - documented, f"written by a run, missing in docs/outputs.md: {sorted(written - documented)}"
    extra = documented - written - set(ONLY_ELSEWHERE)
    assert not extra, f"named in docs/outputs.md, written by no run: {sorted(extra)}"


def test_outputs_page_lists_exactly_the_predictions_jsonl_keys(small_run):
    written = set()
    for path in glob.glob(str(small_run / "*" / "predictions.jsonl")):
        for line in open(path):
            written |= set(json.loads(line))
    documented = documented_keys("## `predictions.jsonl`")
    assert written == documented, (f"missing in docs/outputs.md: {sorted(written - documented)}; "
                                   f"written by no run: {sorted(documented - written)}")


def test_outputs_key_check_fails_on_a_missing_and_on_a_made_up_key(small_run):
    """The check itself: drop a key from the run's record, or add one, and it sees it."""
    record = json.load(open(small_run / "dev" / "metrics.json"))
    documented = documented_keys("## `metrics.json`")
    record["run"]["made_up"] = 1
    assert flatten(record) - documented == {"run.made_up"}
    del record["run"]["made_up"], record["run"]["sample"]
    assert {"run.sample", "run.sample.rows"} <= documented - flatten(record)


# -- the snippets of docs/python-api.md ------------------------------------------------------

def python_snippets(*path: str) -> list:
    return re.findall(r"```python\n(.*?)```", read(*path), flags=re.S)


@contextlib.contextmanager
def snippet_folder(tmp_path, tiny_model, tiny_checkpoint):
    """A folder as the page assumes: ./my-llama, ck.pt, val.csv; offline, one thread."""
    from conftest import write_csv

    os.symlink(tiny_model, tmp_path / "my-llama")
    os.symlink(tiny_checkpoint, tmp_path / "ck.pt")
    write_csv(str(tmp_path / "val.csv"), 23, seed=7)
    before, env = os.getcwd(), {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    os.chdir(tmp_path)
    try:
        with one_thread():
            yield
    finally:
        os.chdir(before)
        for key, value in env.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def test_python_api_snippets_run(tmp_path, tiny_model, tiny_checkpoint, capsys):
    snippets = python_snippets("docs", "python-api.md")
    assert len(snippets) >= 5
    namespace = {}
    with snippet_folder(tmp_path, tiny_model, tiny_checkpoint):
        for i, snippet in enumerate(snippets):
            exec(compile(snippet, f"docs/python-api.md snippet {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "label_column='y': no such column" in out
    assert "True" in out  # the DataLoader's rows are the dataset's, and the training flag came back
    assert namespace["result"].metrics["num_samples"] == 23


def test_readme_snippet_runs(tmp_path, tiny_model, tiny_checkpoint):
    (snippet,) = python_snippets("README.md")
    namespace = {}
    with snippet_folder(tmp_path, tiny_model, tiny_checkpoint):
        exec(compile(snippet, "README.md snippet", "exec"), namespace)
    assert namespace["result"].metrics["num_samples"] == 23


# -- docs/contributing.md: every test file, every module -------------------------------------

def test_contributing_lists_every_test_file_and_every_module():
    page = read("docs", "contributing.md")
    tests = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "tests", "test_*.py")))
    missing = [t for t in tests if f"`{t}`" not in page]
    assert not missing, f"test files not in docs/contributing.md's table: {missing}"
    layout = page.split("## Layout", 1)[1]
    modules = glob.glob(os.path.join(REPO, "dist_eval", "**", "*.py"), recursive=True)
    names = {os.path.basename(p) for p in modules} - {"__init__.py"}
    missing = sorted(n for n in names if n not in layout)
    assert not missing, f"modules not in docs/contributing.md's layout: {missing}"


def test_every_test_the_docs_name_exists():
    """A test the docs name as ``tests/FILE.py::NAME`` (the inventory of what dist_eval changes in petals, the
    notes of the families) is a test of that file: a renamed or moved test leaves no reference behind (two did).
    The dated results are left as they were written."""
    pages = [page for page in markdown_files() if not page.endswith("RESULTS.md")]
    named = {(os.path.relpath(page, REPO), path, name) for page in pages
             for path, name in re.findall(r"(tests/test_\w+\.py)::(test_\w+)", open(page, encoding="utf-8").read())}
    missing = [entry for entry in sorted(named) if not os.path.isfile(os.path.join(REPO, entry[1]))
               or not re.search(rf"def {entry[2]}\b", open(os.path.join(REPO, entry[1]), encoding="utf-8").read())]
    assert named and not missing, missing


def test_the_score_intervals_constants_are_those_the_docs_state():
    from dist_eval.intervals import EXACT_SCORE_ROWS, GROUPED_SCORES_METHOD, MIN_AUROC_SIDE, SCORE_GROUPS

    outputs, api = read("docs", "outputs.md"), read("docs", "python-api.md")
    assert f"Up to {EXACT_SCORE_ROWS:,} rows** (`EXACT_SCORE_ROWS`)" in outputs
    assert f"at least {MIN_AUROC_SIDE:,} rows on each side" in outputs
    assert f"{SCORE_GROUPS:,} equal-count groups (`SCORE_GROUPS`)" in outputs
    assert f"`method` is then\n  `\"{GROUPED_SCORES_METHOD}\"`" in outputs
    assert f"rows x classes up to {EXACT_SCORE_ROWS:,} rows" in api


def test_the_drain_bound_is_the_one_the_docs_state():
    from dist_eval.swarm.drain import DRAIN_TIMEOUT_S

    assert f"at most `DRAIN_TIMEOUT_S` ({DRAIN_TIMEOUT_S:.0f} s," in read("docs", "cluster.md")


def test_readme_is_short_and_holds_no_test_counts_or_timings():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 250
    for path in [os.path.join(REPO, "README.md"), *glob.glob(os.path.join(DOCS, "*.md"))]:
        text = open(path).read()
        assert not re.search(r"\b\d+ tests\b", text), path
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{path}: a dated figure belongs in benchmarks/RESULTS.md"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_of_the_docs_leads_somewhere():
    bad = []
    for path in markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", open(path).read()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(full):
                bad.append(f"{os.path.relpath(path, REPO)}: {target} (no such file)")
            elif anchor and full.endswith(".md"):
                slugs = {_slug(line) for line in open(full) if line.startswith("#")}
                if anchor not in slugs:
                    bad.append(f"{os.path.relpath(path, REPO)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_the_support_table_matches_the_family_table():
    """docs/models-and-checkpoints.md's support table: a row per family, and a family newer
    than petals 2.2.0 (built on another's block) marked as not served by stock petals servers."""
    from dist_eval.backends.families import FAMILIES

    page = read("docs", "models-and-checkpoints.md")
    table = page.split("<!-- support-table -->", 1)[1].split("<!-- /support-table -->", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    by_type = {}
    for row in rows:
        for model_type in re.findall(r"\(`([a-z0-9_]+)`", row[0]):
            by_type.setdefault(model_type, []).append(row)
    assert sorted(by_type) == sorted(FAMILIES)
    for name, family in FAMILIES.items():
        for row in by_type[name]:
            # dist_eval's servers and --backend local
            assert row[1] == "yes" and row[3] == "yes", row
            if family.built_on:
                assert row[2] == "no", row
    assert any("llama3" in row[0] and row[2] == "no" for row in by_type["llama"])
