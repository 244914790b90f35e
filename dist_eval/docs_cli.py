"""``python -m dist_eval.docs_cli > docs/cli.md``: the flag reference, generated from the
commands' own parsers, so the page cannot drift from them (``tests/test_docs.py`` fails when
the committed page differs from this output).

Nothing in a run imports this module.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Tuple

HEADER = """# Command-line reference

Generated from the commands' parsers by `python -m dist_eval.docs_cli > docs/cli.md`; do not
edit by hand (`tests/test_docs.py` fails when this page and the parsers differ). Each command
also prints this with `--help`.
"""

_DIST_EVAL_LAUNCHER = """`dist-eval` (installed with the package; `python -m dist_eval.launcher` is the same) runs
torchrun's launcher in this process and ends with the run's own last line and the exit code
of the rank that failed first (128 + N for a rank killed by signal N).

    dist-eval [torchrun options] [-- dist_eval flags]

Everything before `--` is a torchrun option (`torchrun --help`; default: one rank on this
node), everything after it a flag of `python -m dist_eval` (above).
"""


def commands() -> Dict[str, Tuple[str, Callable[[], argparse.ArgumentParser]]]:
    """{name: (what it is, its parser's builder)} of every command with flags of its own."""
    from dist_eval import cli, compare, power, rescore, shard_merge, verify
    from dist_eval.swarm import cli as swarm_cli
    from dist_eval.swarm import status as swarm_status

    return {
        "python -m dist_eval": ("the evaluation, under `torchrun --nproc_per_node=N -m dist_eval` or "
                                "`dist-eval ... --`", cli.build_parser),
        "python -m dist_eval.swarm": ("serve a model folder on a private or multi-host swarm "
                                      "(`launch/start_server.sh` runs it)", swarm_cli._build_parser),
        "python -m dist_eval.swarm status": ("which blocks of a swarm are served, by whom (`--json` for scripts); "
                                             "the first argument `status` is this subcommand, never a model "
                                             "folder (serve a folder named so as `./status`)",
                                             swarm_status.build_parser),
        "python -m dist_eval.compare": ("two runs side by side, with the paired test", compare.build_parser),
        "python -m dist_eval.rescore": ("every metric of a run again, from its predictions.jsonl",
                                        rescore.build_parser),
        "python -m dist_eval.power": ("plan a comparison of two checkpoints: the rows a difference needs, or the "
                                      "smallest difference a number of rows detects", power.build_parser),
        "python -m dist_eval.shard_merge": ("the shards of a run (`--shard I/K`) merged into the report of the whole "
                                            "set (also `python -m dist_eval.merge`, `python -m dist_eval merge` and "
                                            "`dist-eval merge SHARD_DIR... --output-dir OUT`)",
                                            shard_merge.build_parser),
        "python -m dist_eval.verify": ("a finished report checked against its receipt, its predictions and, with "
                                       "`--backend`, a share of its rows evaluated again (also `python -m dist_eval "
                                       "verify` and `dist-eval verify OUT`)", verify.build_parser),
    }


def _cell(text: str) -> str:
    return " ".join(str(text).replace("%%", "%").replace("|", "\\|").split())


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}` (positional)"
    names = [o for o in action.option_strings if o.startswith("--")] or action.option_strings
    if action.nargs == 0:
        return ", ".join(f"`{n}`" for n in names)
    metavar = action.metavar or (("{" + ",".join(action.choices) + "}") if action.choices
                                 else action.dest.upper())
    more = " ..." if action.nargs in ("+", "*") else ""
    return ", ".join(f"`{n} {metavar}{more}`" for n in names)


def _default_cell(action: argparse.Action) -> str:
    if not action.option_strings or action.default is None:
        return ""
    return f"`{action.default}`" if action.default not in ("", []) else ""


def parser_markdown(parser: argparse.ArgumentParser) -> List[str]:
    """One table per argument group of ``parser``: flag, default, help."""
    lines = [_cell(parser.description or ""), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += [f"#### {group.title}", "", "| flag | default | meaning |", "|---|---|---|"]
        lines += [f"| {_flag_cell(a)} | {_default_cell(a)} | {_cell(a.help or '')} |" for a in actions]
        lines.append("")
    return lines


def markdown() -> str:
    """The whole page."""
    lines = [HEADER]
    for name, (what, build) in commands().items():
        lines += [f"## `{name}`", "", f"{what[0].upper()}{what[1:]}.", ""]
        lines += parser_markdown(build())
        if name == "python -m dist_eval":
            lines += ["## `dist-eval`", "", _DIST_EVAL_LAUNCHER]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
