"""Which command each ``--flag`` written in a Markdown file belongs to, and whether it has it
(used by tests/test_docs.py).

The command of a flag is decided from where it is written:

- on a command line in a code block (continuation lines joined), by the command it follows:
  ``torchrun``/``dist-eval`` options up to ``-m dist_eval`` (or ``--`` for ``dist-eval``),
  then the flags of that module; ``launch/start_server.sh`` takes the swarm's flags,
  ``run_local.sh``/``run_multinode.sh``/``slurm.sbatch`` the run's; ``benchmarks/X.py``
  that script's; pip, pytest and sbatch their own (a short allow-list);
- in prose (a sentence of a paragraph, list item or table row), by the commands the sentence,
  a heading above it, or a command line earlier in its section names; ``python -m
  dist_eval``'s flags always count, as it is the command the docs are about.

petals' own server flags (written with underscores) and the other tools' flags the docs
quote are an explicit allow-list: FOREIGN.
"""
from __future__ import annotations

import ast
import glob
import os
import re
from typing import Dict, Iterator, List, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# flags of programs that are not dist_eval's, as the docs quote them
FOREIGN = {
    "petals server": {"--max_batch_size", "--torch_dtype", "--initial_peers_file", "--num_blocks", "--identity_path"},
    "pip": {"--no-deps", "--upgrade", "--target", "--no-index", "--no-compile", "--no-cache-dir"},
    "pytest": {"--durations", "--dist", "--reverse-order", "--random-order", "--random-order-bucket",
               "--random-order-seed"},
    "py-spy": {"--subprocesses", "--rate", "--format", "--pid", "--native", "--idle"},
    "sbatch": {"--nodes", "--gpus-per-node", "--cpus-per-task", "--ntasks-per-node", "--kill-on-bad-exit",
               "--array", "--dependency", "--parsable", "--requeue"},
}
FOREIGN_FLAGS = set().union(*FOREIGN.values())

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# text naming a command -> the command (order matters: the longer module names first)
NAMED = [
    (re.compile(r"dist_eval\.swarm|start_server\.sh|LocalSwarm"), "swarm"),
    (re.compile(r"dist_eval\.compare"), "compare"),
    (re.compile(r"dist_eval\.rescore"), "rescore"),
    (re.compile(r"dist_eval\.power"), "power"),
    (re.compile(r"dist_eval\.shard_merge|dist-eval merge"), "shard_merge"),
    (re.compile(r"dist_eval\.verify|dist-eval verify|dist_eval verify"), "verify"),
    (re.compile(r"dist_eval\.rendezvous"), "rendezvous"),
    (re.compile(r"torchrun|torch\.distributed\.run|dist-eval|run_multinode\.sh|slurm\.sbatch|run_local\.sh"),
     "torchrun"),
    (re.compile(r"benchmarks/(\w+)\.py|\b(bench_\w+|plain_loop|inprocess_loop)\.py"), "script"),
]


def command_flags() -> Dict[str, Set[str]]:
    """{command: its flags}, from the parsers themselves (and benchmarks' sources)."""
    import torch.distributed.run as torchrun

    from dist_eval import rendezvous
    from dist_eval.docs_cli import commands

    def flags(parser) -> Set[str]:
        return {o for a in parser._actions for o in a.option_strings}

    names = {"python -m dist_eval": "main", "python -m dist_eval.swarm": "swarm",
             "python -m dist_eval.swarm status": "swarm",  # its subcommand's flags count as the swarm's
             "python -m dist_eval.compare": "compare", "python -m dist_eval.rescore": "rescore",
             "python -m dist_eval.shard_merge": "shard_merge", "python -m dist_eval.power": "power",
             "python -m dist_eval.verify": "verify"}
    out: Dict[str, Set[str]] = {}
    for name, (_, build) in commands().items():
        out.setdefault(names[name], set()).update(flags(build()))
    out["torchrun"] = flags(torchrun.get_args_parser())
    out["rendezvous"] = flags(rendezvous.build_parser())
    for path in glob.glob(os.path.join(REPO, "benchmarks", "*.py")):
        out[os.path.basename(path)[:-3]] = _script_flags(path)
    return out


def _script_flags(path: str) -> Set[str]:
    """The ``add_argument("--x", ...)`` flags of a script, read from its source (not imported)."""
    tree = ast.parse(open(path).read())
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


def markdown_files() -> List[str]:
    """Every Markdown file the docs are made of."""
    paths = [os.path.join(REPO, "README.md"), os.path.join(REPO, "benchmarks", "RESULTS.md")]
    return paths + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def units(text: str) -> Iterator[Tuple[str, str]]:
    """(kind, text) of each unit: ("heading", a heading), ("code", one command line of a code
    block, continuation lines joined), ("block", the start of a code block), ("prose", a
    paragraph, list item, table row or quote).
    """
    in_code, prose = False, []
    lines = text.split("\n")

    def flush():
        if prose:
            yield "prose", " ".join(prose)
            prose.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            yield from flush()
            in_code = not in_code
            if in_code:
                yield "block", line
        elif line.startswith("    ") and not prose and not in_code and not COMMAND_START.match(line):
            yield "prose", line  # an indented block that is no command line (a file tree): prose, line by line
        elif in_code or line.startswith("    ") and not prose:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):  # continuation lines
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            yield "code", line
        elif line.startswith("#"):
            yield from flush()
            yield "heading", line
        elif not line.strip() or line.startswith(("- ", "| ", "> ")):
            yield from flush()
            if line.strip():
                prose.append(line)
        else:
            prose.append(line)
        i += 1
    yield from flush()


def _named(text: str) -> Set[str]:
    out = set()
    for pattern, command in NAMED:
        for match in pattern.finditer(text):
            if command == "script":
                out.add(next(g for g in match.groups() if g))
            else:
                out.update({command, "main"} if command == "torchrun" else {command})
    return out


COMMAND_START = re.compile(r"\s*(\$ )?([A-Z_]+=\S+ )*(\S*/)?(python3?|torchrun|dist-eval|pytest|pip|sbatch|--)(\s|$)"
                           r"|\s*(\$ )?([A-Z_]+=\S+ )*\.?/?(launch|\.venv|benchmarks)/")
SENTENCE_END = re.compile(r"(?<=[.;])\s+")
# flags whose value holds another command's flags: --dist-eval-args="--batch-size 256"
NESTED = re.compile(r"(--dist-eval-args|--server-args)=([\"'])(.*?)\2")
NESTED_COMMAND = {"--dist-eval-args": {"main"}, "--server-args": {"swarm"}}


def _command_at(token: str, following: str, current: Set[str]) -> Set[str]:
    """The command whose flags follow ``token`` on a command line (``current`` if it starts none)."""
    launcher = token in ("torchrun", "dist-eval") or token.endswith(("/torchrun", "/dist-eval"))
    if launcher or token == "-m" and following.startswith("torch.distributed.run"):
        return {"torchrun"}
    if token == "-m" and following.startswith("dist_eval"):
        return _named(following) - {"torchrun"} or {"main"}
    if token == "merge" and current == {"torchrun"}:  # dist-eval merge: the shards' merge
        return {"shard_merge"}
    if token == "verify" and current & {"torchrun", "main"}:  # dist-eval verify, python -m dist_eval verify
        return {"verify"}
    if token == "--" and current == {"torchrun"}:
        return {"main"}
    if token.endswith("start_server.sh"):
        return {"swarm"}
    if token.endswith(("run_local.sh", "run_multinode.sh", "slurm.sbatch", "slurm_array.sbatch")):
        return {"main"}
    if token.endswith("slurm_merge.sbatch"):
        return {"shard_merge"}
    if token.endswith(".py") and (_named(token) or "benchmarks/" in token):
        return {os.path.basename(token)[:-3]}
    if token in ("pip", "pytest", "sbatch", "ruff", "py-spy") or token.endswith("/pip"):
        return {"foreign"}
    return current


def command_line_flags(line: str, current: Set[str]) -> Tuple[List[Tuple[str, Set[str]]], Set[str]]:
    """([(flag, the commands it may belong to)] of a command line, by what each follows; the
    command in force at its end). ``current``: the one in force before it.
    """
    found: List[Tuple[str, Set[str]]] = []
    for outer, _, inner in NESTED.findall(line):
        found += [(flag, NESTED_COMMAND[outer]) for flag in FLAG.findall(inner)]
    line = NESTED.sub(lambda m: m.group(1), line)
    code, _, comment = line.partition(" #") if not line.lstrip().startswith("#") else ("", "", line)
    tokens = code.split()
    for i, token in enumerate(tokens):
        current = _command_at(token, tokens[i + 1] if i + 1 < len(tokens) else "", current)
        found += [(flag, current) for flag in FLAG.findall(token)]
    found += [(flag, current | _named(comment)) for flag in FLAG.findall(comment)]
    return found, current


def flags_in(path: str) -> Iterator[Tuple[str, Set[str], str]]:
    """(flag, the commands it may belong to, where) for every flag written in ``path``: a flag
    in prose may belong to ``python -m dist_eval`` or to any command its section (or a section
    it is in) names, in its headings or its text.
    """
    # two passes: the commands run in a section's code blocks, wherever they are in it, count
    # for its prose (and its subsections')
    placed, path_of, code_named = [], [], {}
    for kind, text in units(open(path).read()):
        if kind == "heading":
            level = len(text) - len(text.lstrip("#"))
            path_of = path_of[: level - 1] + [len(placed)]
            code_named[len(placed)] = _named(text)
        elif kind == "code" and path_of:
            code_named[path_of[-1]] |= _named(text)
        placed.append((kind, text, tuple(path_of)))
    current: Set[str] = {"main"}
    for kind, text, where in placed:
        section = {"main"}.union(*(code_named[h] for h in where))
        if kind == "block":
            current = {"main"}
        elif kind == "code":
            found, current = command_line_flags(text, current)
            for flag, commands in found:
                yield flag, commands, text.strip()
        elif kind == "prose":  # by sentence: a paragraph may name one command, then give another's flags
            for sentence in SENTENCE_END.split(text):
                for flag in FLAG.findall(sentence):
                    yield flag, section | _named(sentence), sentence.strip()[:200]


def unknown_flags(paths: List[str], known: Dict[str, Set[str]]) -> List[str]:
    """Every flag written in ``paths`` that none of its commands has, as 'file: flag (commands) in: text'."""
    bad = []
    for path in paths:
        for flag, commands, where in flags_in(path):
            flag = flag.split("=")[0]
            if flag in FOREIGN_FLAGS or any(flag in known.get(c, ()) for c in commands):
                continue
            bad.append(f"{os.path.relpath(path, REPO)}: {flag} (not a flag of {sorted(commands)}) in: {where}")
    return bad
