"""The package's layout rules: no module over its bounds, families named in one table only,
``python -m dist_eval.swarm`` without torch, errors naming API arguments or CLI flags."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

PACKAGE = os.path.join(REPO, "dist_eval")
# the one table of what differs between families, and the layers of its own that it names by
# block option (subclasses of the pinned Llama classes for Qwen3 and Qwen3-MoE)
FAMILY_TABLE = os.path.join(PACKAGE, "backends", "families.py")
FAMILY_LAYERS = os.path.join(PACKAGE, "backends", "layers.py")
MAX_FUNCTION_LINES = 60


def package_files():
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def function_lengths(path):
    """(name, line, length without its docstring) of every function in ``path``."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                length -= first.end_lineno - first.lineno + 1
            yield node.name, node.lineno, length


def test_no_function_over_60_lines():
    long = [f"{os.path.relpath(path, REPO)}:{line} {name} ({n} lines)"
            for path in package_files() for name, line, n in function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not long, "functions over 60 lines (docstrings not counted): " + "; ".join(long)


def test_only_the_family_table_names_a_family():
    # class names, attribute paths and checkpoint prefixes of a family live in backends/families.py
    # (and the layers it names, backends/layers.py)
    pattern = re.compile(r"Llama|Bloom|Falcon|Mistral|Qwen|\.model\.layers|\.embed_tokens|\.word_embeddings|"
                         r"\btransformer\.h\b|[\"']model\.[\"']")
    found = []
    for path in package_files():
        if path in (FAMILY_TABLE, FAMILY_LAYERS):
            continue
        for number, line in enumerate(open(path), 1):
            if pattern.search(line):
                found.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not found, "a family named outside backends/families.py:\n" + "\n".join(found)


def test_swarm_cli_imports_no_torch():
    code = "import sys, runpy; sys.argv = ['x', '--help']\n" \
           "try:\n    runpy.run_module('dist_eval.swarm', run_name='__main__')\nexcept SystemExit:\n    pass\n" \
           "print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_the_api_names_arguments_and_the_cli_names_flags():
    from dist_eval.config import Settings
    from dist_eval.errors import UsageError, flag_names

    with pytest.raises(UsageError) as caught:
        Settings(batch_size=0)
    assert str(caught.value) == "batch_size=0: expected a positive integer."
    with flag_names():
        assert str(caught.value) == "--batch-size 0: expected a positive integer."
    error = UsageError("no such folder.", param="model_dir", value="/x")
    assert str(error) == "model_dir='/x': no such folder."
    with flag_names():
        assert str(error) == "--model /x: no such folder."
    assert str(UsageError("plain message")) == "plain message"


def test_flags_that_do_nothing_in_a_combination_are_refused_naming_the_argument():
    """Issue 50: the stop settings without a stop, --fresh-rows with the store off, were accepted and
    did nothing. The API names its parameters (the CLI's flags: tests/test_cli_bad_input.py)."""
    from dist_eval.config import Options, Settings, settings_from
    from dist_eval.errors import UsageError, flag_names

    for name, value in (("stop_rule", "fixed-width"), ("stop_metric", "brier"), ("stop_round_rows", 64)):
        with pytest.raises(UsageError) as caught:
            settings_from({name: value})
        assert str(caught.value) == (f"{name}={value!r}: does nothing unless the run stops early: expected with "
                                     "stop_at_width or stop_when_decided. Add stop_at_width (a width), or "
                                     "stop_when_decided (two checkpoints), or drop it.")
        with pytest.raises(UsageError):  # validated settings given as they are: the same check
            settings_from({}, settings=Settings(**{name: value}))
        assert settings_from({name: value, "stop_at_width": 0.1})[0].stop_at_width == 0.1
    with pytest.raises(UsageError) as caught:
        Options(fresh_rows=True, row_store="off")
    assert str(caught.value).startswith("fresh_rows: does nothing with the row store off")
    assert str(caught.value).endswith("expected with row_store auto or a folder. Drop it, or give row_store a folder.")
    with flag_names():
        assert "Drop it, or give --row-store a folder." in str(caught.value)
    assert Options(fresh_rows=True, row_store="/tmp/rows").fresh_rows


def test_settings_are_validated_once_for_api_and_cli():
    from dist_eval.config import EvalConfig, Options, Settings
    from dist_eval.errors import UsageError

    for bad in ({"max_length": 0}, {"max_batch_tokens": 0}, {"batch_size": -1}):
        with pytest.raises(UsageError):
            Settings(**bad)
    assert Settings(max_batch_tokens=None).max_batch_tokens is None
    for bad in ({"in_flight": 0}, {"save_interval": -1.0}, {"bootstrap_resamples": -1}, {"bootstrap_seed": -1}):
        with pytest.raises(UsageError):
            Options(**bad)
    config = EvalConfig(max_batch_tokens=0)  # the flag's 0 (no cap) is the API's None, converted once
    assert config.settings.max_batch_tokens is None and config.settings.batch_size == config.batch_size


def test_every_setting_is_in_the_resume_key(tmp_path):
    """A field added to Settings changes the key: none can be forgotten in it."""
    import dataclasses
    import types

    from dist_eval.config import Settings
    from dist_eval.resume import run_key

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    dataset = type("D", (), {"_fingerprint": "f", "column_names": ["text", "label"], "__len__": lambda self: 3})()
    model = types.SimpleNamespace(backend="local", num_labels=3, prompt_tokens=0)
    base = Settings()
    key = run_key(str(model_dir), None, dataset, None, model, base)
    changed = {"text_column": "t", "text_pair_column": "p", "label_column": "y", "batch_size": 3, "max_length": 7,
               "length_buckets": False, "max_batch_tokens": None, "limit": 5, "limit_seed": 1,
               "label_words": ("yes", "no"), "template": "{text} ok", "stop_at_width": 0.02,
               "stop_when_decided": True, "stop_metric": "brier", "stop_round_rows": 7, "stop_rule": "fixed-width"}
    assert set(changed) == {f.name for f in dataclasses.fields(Settings)}
    for name, value in changed.items():
        assert run_key(str(model_dir), None, dataset, None, model, dataclasses.replace(base, **{name: value})) != key


def module_imports():
    """{module: the dist_eval modules it imports}, imports inside functions included; importing
    ``a.b.c`` also runs ``a.b``'s ``__init__``, so it counts as importing the package too."""
    modules = {}
    for path in package_files():
        name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets.update(f"{base}.{alias.name}" for alias in node.names)
                targets.add(base)
        found = set()
        for target in targets:
            parts = target.split(".")
            for end in range(1, len(parts) + 1):  # every package on the way runs its __init__
                prefix = ".".join(parts[:end])
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    found.add(prefix)
        graph[name] = found
    return graph


def test_no_import_cycle_among_the_package_modules():
    """Layers only point down: no module reaches, through any chain of imports (at the top or
    inside functions), back to itself."""
    graph = module_imports()
    assert "dist_eval.plan" in graph["dist_eval.config"] and "dist_eval.pipeline" in graph["dist_eval.cli"]
    cycles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        if cycles:
            break
    assert not cycles, f"an import cycle: {cycles[0]}"


# The package's layers, lowest first, in data-flow order: a module imports only from layers below
# its own (and from inside its own package); two units of one layer never import each other.
LAYERS = (
    ("errors",),  # how every failure is said
    ("chunks",),  # the bounded-memory code's chunk sizes (DIST_EVAL_CHUNK_ROWS)
    ("atomic", "procs", "watchdog", "plan", "metrics", "resampling", "launcher", "rendezvous", "loop_facts",
     "results", "aside"),  # foundations (resampling: the one engine under every bootstrap)
    ("ranks", "intervals", "sequential", "power"),  # the collectives; the statistics under the metrics
    ("data", "backends"),  # the rows; the model (its table, loaders, backends, provenance)
    ("swarm", "predict", "progress", "resume", "paired", "clusters", "config", "demo"),  # servers; the forward
    # loop; the paired and the clustered intervals; settings
    ("run_context",),  # what a CLI run's pairs share, typed: the job, the flags, the model, the clock
    ("scoring", "receipt"),  # the report of a set of rows: point metrics, then intervals; what made it (issue 73)
    ("merge", "rowstore", "demo_build"),  # rank 0's merge; the store of known rows
    ("slices", "known"),  # metrics per slice; the known logits: the resume folder and the row store, one source
    ("exact",),  # one exact evaluation of every row: batches -> forwards -> merge
    ("stopping",),  # the rounds: one of every row, or rounds until the interval says stop
    ("compare", "rescore", "output", "evaluation"),  # the report writers; the evaluation core
    ("job", "verify"),  # what a CLI run evaluates: the flags' or the demo's model and data, found on each node; a
    # report checked against its receipt, its rows evaluated again (issue 73)
    ("pipeline", "shard_merge"),  # the CLI's flow; the shards' merge (the report writers below)
    ("cli",),
    ("docs_cli", "__main__"),
)


def _unit(module: str) -> str:
    """The layer unit of ``dist_eval.a.b``: ``a`` (a top-level module or sub-package)."""
    return module.split(".")[1] if module.count(".") else module


def test_layers_point_down():
    """Issue 47: no import climbs back up: the data stage does not import the model table, the
    backends do not import the CLI's settings, the model loader does not know the row store."""
    layer_of = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
    graph = module_imports()
    units = {_unit(name) for name in graph if name != "dist_eval"}
    assert units == set(layer_of), f"units missing from LAYERS: {sorted(units - set(layer_of))}; " \
                                   f"named but gone: {sorted(set(layer_of) - units)}"
    climbs = [f"{name} imports {target} ({_unit(name)} is in layer {layer_of[_unit(name)]}, "
              f"{_unit(target)} in layer {layer_of[_unit(target)]})"
              for name, targets in sorted(graph.items()) if name != "dist_eval"
              for target in sorted(targets) if target != "dist_eval" and _unit(target) != _unit(name)
              and layer_of[_unit(target)] >= layer_of[_unit(name)]]
    assert not climbs, "imports that do not point down:\n" + "\n".join(climbs)


def test_config_imports_no_higher_module():
    # the backends' table (what each backend takes and is) and what load_model takes are leaves:
    # the flags' checks ask them
    assert module_imports()["dist_eval.config"] == {"dist_eval.errors", "dist_eval.plan", "dist_eval.backends",
                                                    "dist_eval.backends.kinds", "dist_eval.backends.arguments",
                                                    "dist_eval.sequential"}  # the stop metrics and rules, named once
    assert module_imports()["dist_eval.backends.arguments"] == {"dist_eval.errors"}
    assert module_imports()["dist_eval.plan"] == {"dist_eval.errors"}
    assert module_imports()["dist_eval.backends.kinds"] == {"dist_eval.errors"}


def test_flags_keywords_and_resume_key_cannot_drift_apart():
    """Each setting is one field: the CLI has its flag (same default, the flag's 0 where the API
    has None), evaluate() its keyword (same default) and builds the same Settings/Options from
    it; every field of Settings is in the resume key (test_every_setting_is_in_the_resume_key)."""
    import dataclasses
    import inspect

    from dist_eval import evaluate
    from dist_eval.cli import build_parser, flag_of
    from dist_eval.config import EvalConfig, Options, Settings, setting_fields, settings_from

    parser = build_parser()
    flags = {action.dest: action for action in parser._actions if action.option_strings and action.dest != "help"}
    keywords = inspect.signature(evaluate).parameters
    for f in setting_fields():
        assert flag_of(f.name) in flags[f.name].option_strings and f.metadata["help"], f.name
        assert flags[f.name].default == f.default and keywords[f.name].default == f.default, f.name
        assert keywords[f.name].kind is inspect.Parameter.KEYWORD_ONLY
    run_flags = {f.name for f in dataclasses.fields(EvalConfig) if not f.metadata.get("shared")}
    assert set(flags) == run_flags | {f.name for f in setting_fields()}
    # the same values give the same objects through the CLI and through the API
    values = {"batch_size": 3, "template": "t: {text}", "top_k": 1, "in_flight": 4, "limit": 9}
    config = EvalConfig(**values)
    assert (config.settings, config.options) == settings_from(values)
    assert config.settings == Settings(batch_size=3, template="t: {text}", limit=9)
    assert config.options == Options(top_k=1, in_flight=4) and config.batch_size == 3
    assert EvalConfig(max_batch_tokens=0).settings == settings_from({"max_batch_tokens": None})[0]
    with pytest.raises(TypeError, match="'batch_sise'.*did you mean 'batch_size'"):
        settings_from({"batch_sise": 3})



def test_the_model_loading_flags_are_load_models_options():
    """Issue 71: one options object carries the model-loading flags from the CLI to load_model: each flag of
    LOADING_FLAGS is a field of LoadOptions with the flag's default; load_model takes LoadOptions' fields as
    its keywords (one unknown is refused naming the closest, as Python's own), or a LoadOptions."""
    import dataclasses

    from dist_eval.backends.arguments import LoadOptions
    from dist_eval.config import LOADING_FLAGS, EvalConfig

    options = {f.name: f.default for f in dataclasses.fields(LoadOptions)}
    flags = {f.name: f.default for f in dataclasses.fields(EvalConfig)}
    for name in LOADING_FLAGS:
        assert name in options and options[name] == flags[name], name
    config = EvalConfig(backend="local", tuning_mode="ptune", pre_seq_len=4, num_labels=3, device="cpu",
                        swarm_timeout=9.0, stream_blocks=True)
    built = config.load_options(checkpoint="c.pt", head="h.pt")
    assert built == LoadOptions(checkpoint="c.pt", head="h.pt", tuning_mode="ptune", pre_seq_len=4, num_labels=3,
                                swarm_timeout=9.0, stream_blocks=True, audit=0.0)  # its own swarm: no audit
    assert EvalConfig(initial_peers=["/ip4/1.2.3.4/tcp/1/p2p/x"]).load_options().audit is None  # the default share
    assert LoadOptions.of(built, {"device": "cuda"}) == dataclasses.replace(built, device="cuda")
    with pytest.raises(TypeError, match="load_model\\(\\) got an unexpected keyword argument 'checkpiont'; "
                                        "did you mean 'checkpoint'"):
        LoadOptions.of(None, {"checkpiont": "c.pt"})
    with pytest.raises(TypeError, match="options= expected a LoadOptions, got str"):
        LoadOptions.of("c.pt", {})


# the import name of each distribution whose import name differs from it
_IMPORT_TO_DISTRIBUTION = {"sklearn": "scikit-learn", "PIL": "pillow", "huggingface_hub": "huggingface-hub"}
_NOT_LISTED = {"petals": "installed with --no-deps by launch/install.sh (pyproject.toml says why)",
               "cryptography": "installed with hivemind; imported for --sign and verify --key only",
               "wandb": "optional: --report-to wandb", "tensorboard": "optional: --report-to tensorboard"}


def pyproject() -> dict:
    """pyproject.toml (tomllib: Python 3.11, what requires-python allows)."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_pyproject_lists_every_package_dist_eval_imports():
    """Every third-party import of the package is a dependency, or one of the extra "petals" (the swarm's, whose
    pins of the 2023 stack the rest of the package does not need: issue 71)."""
    project = pyproject()
    specs = project["project"]["dependencies"] + project["project"]["optional-dependencies"]["petals"]
    listed = {re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].lower() for spec in specs}
    imported = set()
    for path in package_files():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "dist_eval"}
    missing = sorted(name for name in third_party - set(_NOT_LISTED)
                     if _IMPORT_TO_DISTRIBUTION.get(name, name).lower().replace("_", "-") not in listed)
    assert not missing, f"imported by dist_eval but not in pyproject.toml's dependencies: {missing}"
    assert {"tqdm", "jinja2", "scipy"} <= third_party  # the libraries issue 41 put to use


def test_torch_older_than_2_6_is_refused_by_the_package_and_the_install(tmp_path):
    """Issue 50. Before: pyproject.toml allowed torch 2.1, and launch/install.sh kept any torch in the
    venv; before 2.6, torch.load (petals' and transformers 4.33's reading of a pytorch_model.bin)
    runs the file's pickled code. The install's check is run on torch packages of each version."""
    from packaging.requirements import Requirement

    project = pyproject()
    torch_spec = next(Requirement(s) for s in project["project"]["dependencies"] if Requirement(s).name == "torch")
    assert "2.5.1" not in torch_spec.specifier and "2.6.0" in torch_spec.specifier
    assert "2.13.0" in torch_spec.specifier
    script = open(os.path.join(REPO, "launch", "install.sh")).read()
    check = re.search(r"^TORCH_AT_LEAST_2_6='([^']*)'$", script, re.M).group(1)
    assert '"$VENV/bin/python" -W ignore -c "$TORCH_AT_LEAST_2_6"' in script  # what decides the install
    for version, older in (("2.5.1+cu121", True), ("2.1.2", True), ("1.13.1", True), ("2.6.0", False),
                           ("2.13.0+cpu", False), ("2.10.0a0+git1234", False), ("3.0.0", False)):
        fake = tmp_path / version / "torch"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
        proc = subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": str(fake.parent)},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == (1 if older else 0), (version, proc.stderr)


def test_the_report_templates_are_package_data():
    import importlib.resources

    project = pyproject()
    assert project["tool"]["setuptools"]["package-data"]["dist_eval.output"] == ["templates/*"]
    templates = importlib.resources.files("dist_eval.output") / "templates"
    assert sorted(p.name for p in templates.iterdir()) == ["report.css", "report.html.j2"]


def test_the_rows_are_drawn_in_one_place():
    """Issue 47: the --limit sample is drawn, and rows keyed by their content for it, only in
    dist_eval/data/sample.py (draw_rows); the rest of the package passes its Rows down."""
    drawing = {"key_order", "sample_indices", "sample_rows"}
    calls = []
    for path in package_files():
        if path.endswith(os.path.join("data", "sample.py")):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in drawing:
                    calls.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {name}()")
    assert not calls, "the sample drawn outside data/sample.py: " + "; ".join(calls)


def test_every_run_is_the_one_loop_of_rounds():
    """Issue 47: a run that does not stop early is one round of every row; the one exact evaluation
    (exact.evaluate_once) is called by the rounds' one loop (stopping.evaluate_rows) and nowhere else,
    and evaluation.py enters that loop once, for evaluate(), evaluate_pair() and the CLI alike."""
    callers = {}
    for path in package_files():
        tree = ast.parse(open(path).read())
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in ("evaluate_once", "evaluate_rows"):
                    callers.setdefault(name, set()).add(f"{os.path.relpath(path, REPO)}:{function.name}")
    assert callers == {"evaluate_once": {"dist_eval/stopping.py:evaluate_rows"},
                       "evaluate_rows": {"dist_eval/evaluation.py:evaluate_models"}}, callers
