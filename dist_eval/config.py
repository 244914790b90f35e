"""Every setting of a run, declared once: its default, its help, its check.

- :class:`Settings`: what decides which rows are evaluated and each row's logits (the
  data's columns and the batch plan). Every field is part of the resume key.
- :class:`Options`: what changes no result (batches in flight, saving, the bootstrap).
- :class:`EvalConfig`: a CLI run: the run's own fields (the model, the data, the swarm,
  the outputs) and one :class:`Settings` and one :class:`Options`.

A field of these classes is the one declaration of its setting: the CLI flag
(``batch_size`` <-> ``--batch-size``, its help and type), the keyword of
:func:`dist_eval.evaluate` (its signature lists the fields of Settings and Options), the
check (in ``__post_init__``) and, for Settings, the resume key all follow from it; a
test holds them together. Adding a setting means adding its field and the code that uses
it, nothing else.

A :class:`~dist_eval.errors.UsageError` raised here names the parameter: the API shows
it as ``batch_size=0``, the CLI as ``--batch-size 0``. This module checks its own fields
only (standard library, :mod:`dist_eval.plan`); what needs a model folder's family, a
tracker's package or the machine's devices is checked by the CLI before its first phase.
"""
from __future__ import annotations

import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from dist_eval.backends.arguments import DEFAULT_SWARM_TIMEOUT, LoadOptions, audit_share, is_hub_id, read_label_words
from dist_eval.backends.kinds import BACKENDS, backend_kind
from dist_eval.errors import UsageError
from dist_eval.plan import parse_checkpoints, parse_plan
from dist_eval.sequential import FIXED_WIDTH, RULES, STOP_METRICS, TIME_UNIFORM

# Defaults chosen from benchmarks/RESULTS.md: on a swarm, fewer and bigger forwards win
# (each one pays a round trip and per-request work on every server), and a token cap
# keeps a batch of long rows within a Petals server's --max_batch_size (2048 tokens by
# default, prompt vectors included) while rows of similar length fill it. A batch goes
# to the swarm as one request (backends/petals/requests.py), so the cap is the request size.
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_BATCH_TOKENS = 2048
DEFAULT_MAX_LENGTH = 512
# Batches in flight per rank: 2 overlaps one batch's network wait with the next one's
# work; more gains little on a small swarm (benchmarks/RESULTS.md).
DEFAULT_IN_FLIGHT = 2
DEFAULT_SAVE_INTERVAL = 10.0
DEFAULT_BOOTSTRAP_RESAMPLES = 1000
# Rows per round of a run that stops early (--stop-at-width): the interval is looked at after
# each round. Smaller rounds stop closer to the rows the answer needs, each costing one more
# evaluate() (a merge, and on a swarm a few round trips); the stopping round is the same for
# any world size, since a round is a count of rows, not of batches.
DEFAULT_STOP_ROUND_ROWS = 256
# The per-row metrics a run can stop on and the rules it stops by, named where they are computed
STOP_METRIC_NAMES = tuple(STOP_METRICS)
STOP_RULE_NAMES = RULES
# --row-store values that turn the store off (as dist_eval.rowstore.store_root reads them)
STORE_OFF = ("off", "none", "0")




def setting(default: Any, help: str, *, zero_is_none: bool = False, **flag) -> Any:
    """One setting's declaration: a dataclass field with its default and help. ``flag``:
    argparse's ``nargs``/``choices``/``action`` for its CLI flag; ``zero_is_none``: the
    flag's 0 is the API's None.
    """
    return field(default=default, metadata={"help": help, "flag": flag, "zero_is_none": zero_is_none})


def check_int(param: str, value, minimum: int, expected: str = "a positive integer") -> None:
    """``value`` must be an int >= ``minimum``."""
    if not isinstance(value, int) or value < minimum:
        raise UsageError(f"expected {expected}.", param=param, value=value)


def check_seconds(param: str, value, *, allow_zero: bool = False) -> None:
    """A number of seconds: > 0, or >= 0 with ``allow_zero``."""
    if value < 0 or (value == 0 and not allow_zero):
        expected = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        raise UsageError(f"expected {expected}.", param=param, value=value)


def check_template(template: Optional[str], text_pair_column: Optional[str]) -> None:
    """A template holds ``{text}`` once, and ``{text_pair}`` exactly when there is a pair column."""
    if template is None:
        return
    if not isinstance(template, str) or template.count("{text}") != 1:
        raise UsageError("expected a text with the placeholder {text} once (where each row's text goes), e.g. "
                         "'Review: {text} Sentiment:'.", param="template", value=template)
    if ("{text_pair}" in template) != (text_pair_column is not None):
        fix = ("add {text_pair} where the second text goes" if text_pair_column
               else "drop {text_pair} or pass the second text's column (text_pair_column)")
        raise UsageError(f"{{text_pair}} must be in it exactly when there is a text pair column; {fix}.",
                         param="template", value=template)


_MAX_BATCH_TOKENS = (
    "And at most this many padded tokens per forward: rows x (longest row + prompt vectors); 0 (API: None): no "
    "cap. A batch goes to the swarm as one request; a server that accepts fewer tokens (its --max_batch_size: "
    "petals' default is 2048, 8192 for grouped-query models) has it split."
)
_LIMIT = (
    "Evaluate a seeded random sample of this many rows (without replacement; chosen by a hash of each row's "
    "content: the same rows for any number of ranks and any order of the files); 0: every row."
)
_STOP_AT_WIDTH = (
    "Stop early: evaluate the rows in the --limit order (a seeded hash of each row's content), in rounds of "
    "--stop-round-rows rows over all ranks, and stop at the first round whose 95%% interval of --stop-metric "
    "over the whole set (--stop-rule: time-uniform by default, valid although the run chose when to stop) is at "
    "most this wide, e.g. 0.02 for +-1 point of accuracy; or at the end of the set. With two --checkpoint's and "
    "--stop-when-decided, the width of the interval of their difference. 0 (the default; API: None): every row."
)
_STOP_WHEN_DECIDED = (
    "With two --checkpoint's: evaluate both on the same rows in rounds (as --stop-at-width) and stop as soon "
    "as the 95%% time-uniform interval of the difference in --stop-metric (second - first) excludes 0, or is "
    "at most --stop-at-width wide, or the set ends."
)
_STOP_RULE = (
    "What --stop-at-width stops on. time-uniform: a 95%% confidence sequence (valid at every round at once, so "
    "the interval stays valid if you look at it and evaluate more rows; its weights tuned to reach the width in "
    "the fewest rows: about 1.5-2.5x the rows of a fixed-sample interval of that width). fixed-width: the "
    "fixed-sample 95%% interval of the rows seen, at the first round it is at most --stop-at-width wide (about "
    "the rows a fixed sample of that width needs; about 95%% coverage for this rule only: not if you then "
    "evaluate more rows). Not with --stop-when-decided; only with --stop-at-width (else refused)."
)
_LABEL_WORDS = (
    "Zero-shot: score each class by the language model's log-probability of its word after the text (one "
    "word per class, in class-id order; @FILE: one word per line). No classifier head or --checkpoint is "
    "needed; a ptune --checkpoint's prompts are used (its head is not)."
)
_TEMPLATE = (
    "Each row's text is put in this template before tokenizing, at {text} (and {text_pair} with "
    "--text-pair-column), e.g. 'Review: {text} Sentiment:'. Default: the text as it is."
)
_ROW_STORE = (
    "The store of evaluated rows every later run reuses (keyed by the model's and checkpoint's content, the "
    "numerics, the tokenizer and the settings that change a row's logits): a folder, off, or auto "
    "($DIST_EVAL_ROW_STORE, else $DIST_EVAL_CACHE/rows, ~/.cache/dist_eval/rows). A row read from it has the "
    "logits of the run that evaluated it. Safe to delete at any time."
)
_SHARD = (
    "Evaluate only shard I of K (0 <= I < K) of the set: the batches of the whole set's batch plan dealt to it "
    "(the same split for any number of ranks), written with what `python -m dist_eval.shard_merge` needs to "
    "build the whole set's report, equal bit for bit to one run (docs/cluster.md). Default: none; in a SLURM "
    "job array, the array task's place in the array, of SLURM_ARRAY_TASK_COUNT. Not with --stop-at-width or "
    "--stop-when-decided, nor several sets or checkpoints."
)


def parse_shard(value) -> Optional[str]:
    """``shard`` as "I/K" (from "I/K" or (I, K)), 0 <= I < K; None: the whole set."""
    parts = value.split("/") if isinstance(value, str) else value
    try:
        index, count = (int(part) for part in parts)
    except (TypeError, ValueError):
        index = count = -1
    if value is not None and not (isinstance(value, (str, tuple, list)) and 0 <= index < count):
        raise UsageError("expected I/K, shard I of K with 0 <= I < K (e.g. 0/3, 1/3, 2/3), or none: the whole set.",
                         param="shard", value=value)
    return None if value is None else f"{index}/{count}"


def shard_from_slurm(env) -> Optional[str]:
    """The shard of a SLURM job array's task: its place among the array's task ids
    (SLURM_ARRAY_TASK_ID from SLURM_ARRAY_TASK_MIN in steps of SLURM_ARRAY_TASK_STEP) of
    SLURM_ARRAY_TASK_COUNT; None outside an array. An array whose ids are not such a range is refused.
    """
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None
    names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")
    try:
        task, first, count = (int(env[name]) for name in names)
        step = int(env.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
    except (KeyError, ValueError):
        task = first = count = step = 0
    index = (task - first) // step if step > 0 else -1
    if step <= 0 or (task - first) % step or not 0 <= index < count:
        shown = ", ".join(f"{name}={env.get(name)}" for name in (*names, "SLURM_ARRAY_TASK_STEP"))
        raise UsageError(f"cannot tell this array task's shard from {shown} (an --array of ids in one range "
                         "A-B[:STEP] is read as shards 0..K-1). Pass --shard I/K to each task.", param="shard")
    return f"{index}/{count}"


_FRESH_ROWS = ("Evaluate every row afresh: read no row from the row store (the rows are still written to it). "
               "Not with --row-store off.")


@dataclass(frozen=True)
class Settings:
    """What decides which rows are evaluated and each row's logits. Every field is part of
    the resume key.
    """

    text_column: str = setting("text", "Column with the input text.")
    text_pair_column: Optional[str] = setting(None, "Optional second text column (sentence pairs).")
    label_column: str = setting("label", "Column with the labels: integer class ids in [0, num_labels), or texts "
                                         "(mapped to ids through the model's class names, else sorted).")
    batch_size: int = setting(DEFAULT_BATCH_SIZE, "At most this many rows per forward pass.")
    max_length: int = setting(DEFAULT_MAX_LENGTH, "Longer texts are truncated to this many tokens (counted in "
                                                  "the report).")
    length_buckets: bool = setting(True, "Batch rows of similar token length together (less padding; results "
                                         "unchanged).")
    max_batch_tokens: Optional[int] = setting(DEFAULT_MAX_BATCH_TOKENS, _MAX_BATCH_TOKENS, zero_is_none=True)
    limit: int = setting(0, _LIMIT)  # dist_eval.data.sample
    limit_seed: int = setting(0, "Seed of the --limit sample.")
    # zero-shot (dist_eval.backends.zeroshot): the words scored for the classes, in class-id order
    label_words: Optional[Tuple[str, ...]] = setting(None, _LABEL_WORDS, nargs="+")
    template: Optional[str] = setting(None, _TEMPLATE)
    # stopping early (dist_eval.stopping): which rows are evaluated depends on these
    stop_at_width: Optional[float] = setting(None, _STOP_AT_WIDTH, zero_is_none=True)
    stop_when_decided: bool = setting(False, _STOP_WHEN_DECIDED)
    stop_metric: str = setting("accuracy", "The per-row metric --stop-at-width and --stop-when-decided look at "
                                           "(API: also a sample_metrics name, its values within [0, 1]).",
                               choices=list(STOP_METRIC_NAMES))
    stop_round_rows: int = setting(DEFAULT_STOP_ROUND_ROWS, "Rows per round of a run that stops early (over "
                                                            "all ranks): the interval is looked at after each.")
    stop_rule: str = setting(TIME_UNIFORM, _STOP_RULE, choices=list(STOP_RULE_NAMES))

    @property
    def stops_early(self) -> bool:
        """Rows are evaluated in rounds until an interval says stop (dist_eval.stopping)."""
        return self.stop_at_width is not None or self.stop_when_decided

    def __post_init__(self) -> None:
        object.__setattr__(self, "label_words", read_label_words(self.label_words))
        check_template(self.template, self.text_pair_column)
        check_int("batch_size", self.batch_size, 1)
        check_int("limit", self.limit, 0, "an integer >= 0 (0: every row)")
        check_int("limit_seed", self.limit_seed, 0, "an integer >= 0")
        check_int("max_length", self.max_length, 1)
        if self.max_batch_tokens is not None:
            check_int("max_batch_tokens", self.max_batch_tokens, 1,
                      "a positive number of tokens, or no cap: None (the API), 0 (the CLI)")
        if self.stop_at_width is not None and (
                isinstance(self.stop_at_width, bool) or not isinstance(self.stop_at_width, (int, float))
                or not 0 < self.stop_at_width <= 2):
            raise UsageError("expected a width in (0, 2] (the interval's high - low, e.g. 0.02 for +-1 point), "
                             "or 0 (API: None): every row.", param="stop_at_width", value=self.stop_at_width)
        check_int("stop_round_rows", self.stop_round_rows, 1)
        self._check_stop_rule()
        if not isinstance(self.stop_metric, str) or not self.stop_metric:
            raise UsageError(f"expected a metric name: one of {', '.join(STOP_METRIC_NAMES)} (or, in the API, a "
                             "sample_metrics name).", param="stop_metric", value=self.stop_metric)

    def _check_stop_rule(self) -> None:
        if self.stop_rule not in STOP_RULE_NAMES:
            raise UsageError(f"expected one of {', '.join(STOP_RULE_NAMES)}.", param="stop_rule", value=self.stop_rule)
        if self.stop_rule == FIXED_WIDTH and self.stop_when_decided:
            raise UsageError("the fixed-width rule stops once its interval is at most --stop-at-width wide, and "
                             "cannot decide which checkpoint is better (looking at a fixed-sample test after every "
                             "round is not a valid test): drop --stop-when-decided, or --stop-rule.",
                             param="stop_rule", value=self.stop_rule)

    def check_stop_flags(self) -> None:
        """--stop-rule, --stop-metric and --stop-round-rows given (not their defaults) where nothing
        stops early do nothing: refused. Not in ``__post_init__``: a round of a run that stops
        early (dist_eval.stopping) is one exact run with these settings kept.
        """
        if self.stops_early:
            return
        for name in ("stop_rule", "stop_metric", "stop_round_rows"):
            value = getattr(self, name)
            if value != Settings.__dataclass_fields__[name].default:
                raise UsageError("does nothing unless the run stops early: expected with {0} or {1}. Add {0} "
                                 "(a width), or {1} (two checkpoints), or drop it.", param=name, value=value,
                                 names=("stop_at_width", "stop_when_decided"))

    def as_dict(self) -> dict:
        return asdict(self)


_SLICE_BY = (
    "Every metric (and its interval) also per value of each of these columns of the data, and per quartile "
    "of the rows' token length (the flag alone: those only): metrics.json's slices, slices.csv, the worst "
    "slices in the summary. From the rows already evaluated (no new forward pass)."
)


_CLUSTER_BY = (
    "Rows that share a value of this column are one cluster (a passage's questions, a conversation's turns): "
    "every interval resamples whole clusters; the report gives the clusters, the design effect and the "
    "intervals of independent rows beside them (docs/statistics.md). Not with --stop-at-width or "
    "--stop-when-decided."
)


def _slice_columns(value) -> Tuple[str, ...]:
    """``slice_by`` as a tuple of distinct column names."""
    columns = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(c, str) and c for c in columns) or len(set(columns)) != len(columns):
        raise UsageError("expected distinct column names (none: the token-length quartiles only).",
                         param="slice_by", value=value)
    return tuple(columns)


@dataclass(frozen=True)
class Options:
    """What changes no result: throughput, saving partial results, the bootstrap."""

    in_flight: int = setting(DEFAULT_IN_FLIGHT, "Batches in flight at once on each rank (overlaps network waits; "
                                                "results unchanged).")
    save_interval: float = setting(DEFAULT_SAVE_INTERVAL, "Seconds between each rank's atomic saves of finished "
                                                          "batches (partial results; 0: every batch).")
    bootstrap_resamples: int = setting(
        DEFAULT_BOOTSTRAP_RESAMPLES,
        "Resamples of the bootstrap confidence intervals (level 0.95) of accuracy, macro-F1, loss and the "
        "probability scores (0 disables).",
    )
    bootstrap_seed: int = setting(0, "Seed of the bootstrap: the same seed gives the same intervals.")
    top_k: Optional[int] = setting(None, "The k of the top-k accuracy (top{K}_accuracy in metrics.json); "
                                         "default: 2 with more than 2 classes, none with 2.")
    # the row store (dist_eval.rowstore): a row's logits as the run that evaluated it computed them
    row_store: str = setting("auto", _ROW_STORE)
    fresh_rows: bool = setting(False, _FRESH_ROWS)
    slice_by: Optional[Tuple[str, ...]] = setting(None, _SLICE_BY, nargs="*")
    cluster_by: Optional[str] = setting(None, _CLUSTER_BY, metavar="COLUMN")
    # a part of the set (separately launched shards, merged by dist_eval.shard_merge): no row's result changes
    shard: Optional[str] = setting(None, _SHARD)

    @property
    def shard_part(self) -> Optional[Tuple[int, int]]:
        """(I, K) of ``shard``; None: the whole set."""
        return None if self.shard is None else tuple(int(part) for part in self.shard.split("/"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard", parse_shard(self.shard))
        if self.slice_by is not None:
            object.__setattr__(self, "slice_by", _slice_columns(self.slice_by))
        if self.cluster_by is not None and (not isinstance(self.cluster_by, str) or not self.cluster_by):
            raise UsageError("expected the name of a column of the data.", param="cluster_by", value=self.cluster_by)
        check_int("in_flight", self.in_flight, 1)
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1, "a positive integer (the k of top-k accuracy)")
        check_seconds("save_interval", self.save_interval, allow_zero=True)
        check_int("bootstrap_resamples", self.bootstrap_resamples, 0, "an integer >= 0 (0 disables the intervals)")
        check_int("bootstrap_seed", self.bootstrap_seed, 0, "an integer >= 0")
        if not isinstance(self.row_store, (str, os.PathLike)) or not str(self.row_store).strip():
            raise UsageError("expected a folder, 'auto' (the dist_eval cache's rows/ folder) or 'off'.",
                             param="row_store", value=self.row_store)
        object.__setattr__(self, "row_store", os.fspath(self.row_store))
        if self.fresh_rows and self.row_store.strip().lower() in STORE_OFF:
            raise UsageError("does nothing with the row store off (nothing is read from it anyway): expected with "
                             "{0} auto or a folder. Drop it, or give {0} a folder.", param="fresh_rows",
                             names=("row_store",))


def split_settings(values: Dict[str, Any], *, from_flags: bool = False) -> Tuple[Settings, Options, Dict[str, Any]]:
    """``values`` (keywords or flags by field name) as (:class:`Settings`, :class:`Options`,
    the rest). ``from_flags``: a flag's 0 is None where the declaration says so.
    """
    rest, built = dict(values), []
    for cls in (Settings, Options):
        mine = {f.name: rest.pop(f.name) for f in fields(cls) if f.name in rest}
        if from_flags:
            mine.update({f.name: None for f in fields(cls) if f.metadata["zero_is_none"] and mine.get(f.name) == 0})
        built.append(cls(**mine))
    return built[0], built[1], rest


def setting_fields() -> list:
    """The fields of :class:`Settings` and :class:`Options`: the settings the API and the CLI share."""
    return [*fields(Settings), *fields(Options)]


_PETALS_OR_LOCAL = "petals: blocks run on a swarm; local: the same model in-process (the reference)."
_INITIAL_PEERS = (
    "Swarm multiaddrs. Omitted with --backend petals: a local swarm serving --model is started for the run."
)
_SWARM_TIMEOUT = (
    "Seconds to wait for the swarm to serve every block before failing; also how long a batch is retried when "
    "every server of some block fails mid-run."
)
_AUDIT = (
    "The share of the rows computed again on other servers (each drawn by its content: the same for any N) and "
    "compared, and each server's first request: a server found wrong is named and left out (its answers "
    "computed again), or the run stops naming it. "
    "Default: 0.03 ($DIST_EVAL_AUDIT) with --initial-peers, 0 on the run's own local swarm; 0 turns it off."
)
_SERVERS_4X_CONFIG = (
    "With --initial-peers: the swarm's stock petals servers were started from a copy of --model whose config.json "
    "is in transformers 4.x's form (top-level rope_theta, rope_scaling), so they read the RoPE right; without it, "
    "a --model saved by transformers 5.x (rope_parameters) is refused on stock servers, which read that form wrong."
)
_PROGRESS = (
    "Progress of all ranks, on stderr from rank 0: bar (tqdm), log (plain lines for job logs), none; "
    "auto = bar on a terminal, else log (none with --quiet or TQDM_DISABLE, which also turns bar off)."
)
_DATA_FILES = (
    "Data: csv/tsv/json/jsonl/parquet files, a save_to_disk folder, or a hub dataset name. Several sets in "
    "one run: NAME=FILE[,FILE...] each (e.g. dev=dev.jsonl test=a.jsonl,b.jsonl), each reported in "
    "OUTPUT_DIR/NAME."
)
_CHECKPOINT = (
    "Trained prompt embeddings + classifier head (dist_eval's file, a Petals state dict, petals #268's "
    "torch.save(prompt_embeddings) with --head, or a PEFT PROMPT_TUNING / P_TUNING adapter: its folder, its "
    "adapter_model.safetensors or its hub id). Repeat it for several checkpoints of one structure, "
    "evaluated with the model loaded once, each reported in OUTPUT_DIR/NAME (NAME: the file's stem, "
    "or NAME=FILE)."
)
_HEAD = (
    "The classifier head: of a --checkpoint that holds only prompts, or without --checkpoint the head alone "
    "(a causal LM --model whose family has no *ForSequenceClassification save, as GLM-4.5's): a file with "
    "score.weight, or a model folder holding a trained one (e.g. a *ForSequenceClassification save)."
)
_DEMO_FAMILY = (
    "Model family (config.json model_type) of the built-in demo (no --model): the same task on a small model "
    "of this family, shipped with dist_eval (bloom, falcon, llama, mistral, qwen2). Default: the embedded demo's."
)
_LOCAL_SERVERS = (
    "Servers of the local swarm started when --initial-peers is omitted (default: 2 on the CPU; on GPUs "
    "as many per GPU as fit in half its memory, at most 8). Each holds every block where they all fit in "
    "half the memory; else every block is on two of them."
)


@dataclass(init=False)
class EvalConfig:
    """A CLI run: one field per flag of its own, and the shared :class:`Settings` and
    :class:`Options` (``settings``, ``options``), validated on construction.

    Built from flags by field name, ``EvalConfig(batch_size=8, model=...)``: each goes to the
    class that declares it, and reads back the same way (``config.batch_size``).
    """

    # what to evaluate
    model: Optional[str] = setting(None, "Folder saved with save_pretrained (config, weights, tokenizer), or a hub "
                                         "id (org/name: with --backend petals --initial-peers, only the client's "
                                         "files are fetched). Omit with --data-files for the built-in demo.")
    revision: Optional[str] = setting(None, "Hub revision (branch, tag or commit) of a --model hub id.")
    fetch_whole_model: bool = setting(False, "With a --model hub id where the run reads every block (--backend "
                                             "local, or a local swarm): download every weight file into the HF "
                                             "cache (without it, such a run says how much that is and stops).")
    stream_blocks: bool = setting(False, "--backend local: keep the blocks in the model's files, each read when the "
                                         "forward reaches it and freed after: the same logits bit for bit, in the "
                                         "memory of one block (CPU only). With a --model hub id, each block's "
                                         "shards are fetched when it first runs.")
    data_files: Optional[List[str]] = setting(None, _DATA_FILES, nargs="+")
    split: Optional[str] = setting(None, "Split to evaluate (needed for a save_to_disk DatasetDict; loose files "
                                         "are one split).")
    num_labels: Optional[int] = setting(None, "Number of classes; must match the classifier head (read from the "
                                              "checkpoint by default).")
    # the model
    backend: str = setting("petals", _PETALS_OR_LOCAL, choices=list(BACKENDS))
    initial_peers: Optional[List[str]] = setting(None, _INITIAL_PEERS, nargs="+")
    dht_prefix: Optional[str] = setting(None, "DHT prefix the swarm's servers announce the model under.")
    checkpoint: Optional[List[str]] = setting(None, _CHECKPOINT, action="append")
    head: Optional[str] = setting(None, _HEAD)
    demo_family: Optional[str] = setting(None, _DEMO_FAMILY)
    tuning_mode: Optional[str] = setting(None, "Prompt tuning mode of the checkpoint (read from it by default).",
                                         choices=["ptune", "deep_ptune"])
    pre_seq_len: int = setting(0, "Number of prompt vectors (needs --tuning-mode; read from the checkpoint by "
                                  "default).")
    # an interrupted run
    resume: bool = setting(True, "Reuse the partial results an interrupted run of the same model, data and "
                                 "settings stored in --output-dir.")
    # outputs
    save_logits: bool = setting(False, "Also write each row's logits to predictions.jsonl.")
    save_text: bool = setting(False, "Also write each row's text (and text pair) to predictions.jsonl.")
    output_dir: str = setting("dist_eval_output", "Where metrics.json and predictions.jsonl go.")
    # the swarm and the process group
    local_servers: Optional[int] = setting(None, _LOCAL_SERVERS)
    local_device: str = setting("auto", "Where that local swarm's servers compute: auto (every visible GPU if "
                                        "any, else the CPU), cpu, cuda or cuda:K.")
    swarm_timeout: float = setting(DEFAULT_SWARM_TIMEOUT, _SWARM_TIMEOUT)
    audit: Optional[float] = setting(None, _AUDIT)
    servers_started_from_4x_config: bool = setting(False, _SERVERS_4X_CONFIG)
    dist_timeout: float = setting(900.0, "Seconds a collective may wait for the other ranks before failing.")
    dist_backend: str = setting("gloo", "Process group backend: gloo (any N, wherever the ranks run) or nccl "
                                        "(one GPU per rank).", choices=["gloo", "nccl"])
    device: str = setting("cpu", "Where --backend local computes: cpu, cuda (each rank on cuda:LOCAL_RANK %% "
                                 "device_count) or cuda:K.")
    # what is shown
    quiet: bool = setting(False, "Print only errors and the final one-line result.")
    progress: str = setting("auto", _PROGRESS, choices=["auto", "bar", "log", "none"])
    report_to: str = setting("none", "Also log the final metrics and confusion matrix to wandb or tensorboard "
                                     "(its package must be installed).", choices=["none", "wandb", "tensorboard"])
    sign: Optional[str] = setting(None, "Sign the report's receipt (metrics.json's run.receipt) with this Ed25519 "
                                        "private key (a PEM file, unencrypted); the public key goes in the receipt. "
                                        "python -m dist_eval.verify --key checks it.", metavar="KEY")
    # the shared settings: not flags themselves, their fields are
    settings: Settings = field(default_factory=Settings, metadata={"shared": True})
    options: Options = field(default_factory=Options, metadata={"shared": True})

    def __init__(self, **flags) -> None:
        settings, options, own = split_settings(flags, from_flags=True)
        unknown = sorted(set(own) - {f.name for f in run_fields()})
        if unknown:
            raise TypeError(f"EvalConfig: no such flag(s) {unknown}; the flags are the fields of EvalConfig, "
                            "Settings and Options.")
        for f in run_fields():
            setattr(self, f.name, own.get(f.name, f.default))
        self.settings, self.options = settings, options
        self._check()

    def __getattr__(self, name: str):
        # called only for names not set on the instance: a shared setting, read where it lives
        for shared in ("settings", "options"):
            held = self.__dict__.get(shared)
            if held is not None and name in held.__dataclass_fields__:
                return getattr(held, name)
        raise AttributeError(f"'EvalConfig' object has no attribute {name!r}")

    def _check(self) -> None:
        if (self.model is None) != (self.data_files is None):
            given, missing = ("--model", "--data-files") if self.model else ("--data-files", "--model")
            raise UsageError(f"{missing}: needed with {given} (or omit both to run the built-in demo).")
        kind = backend_kind(self.backend)
        if self.device != "cpu" and not kind.computes_here:
            raise UsageError("only --backend local computes here; a Petals client's tensors stay on the CPU.",
                             param="device", value=self.device)
        if self.stream_blocks:
            kind.with_blocks_streamed()
            if self.device != "cpu":
                raise UsageError("expected cpu: the blocks streamed from disk are computed on the CPU. Pass "
                                 "--device cpu, or drop --stream-blocks.", param="device", value=self.device)
        self._check_label_words()
        if self.local_servers is not None:
            check_int("local_servers", self.local_servers, 1)
        check_seconds("swarm_timeout", self.swarm_timeout)
        if self.audit is not None:
            if not kind.on_swarm:
                raise UsageError(f"only a swarm's servers are audited; --backend {self.backend} computes every row "
                                 "here. Drop it.", param="audit", value=self.audit)
            audit_share(self.audit)
        check_seconds("dist_timeout", self.dist_timeout)
        if self.num_labels is not None:
            check_int("num_labels", self.num_labels, 2, "at least 2 classes")
        check_int("pre_seq_len", self.pre_seq_len, 0, ">= 0")
        if self.pre_seq_len and not self.tuning_mode:
            raise UsageError("needs --tuning-mode ptune or deep_ptune.", param="pre_seq_len", value=self.pre_seq_len)
        if self.initial_peers and not kind.on_swarm:
            raise UsageError("--initial-peers: only used with --backend petals.")
        self._plan()
        self.settings.check_stop_flags()
        check_not_with_stopping(self.settings, self.options)
        if self.options.shard is not None and self.plan is not None and self.plan.several:
            raise UsageError("a shard is a part of one set for one checkpoint: expected one --checkpoint and one "
                             "set in --data-files. Launch the shards of each pair apart.", param="shard",
                             value=self.options.shard)
        if self.settings.stop_when_decided and (
                self.plan is None or len(self.plan.checkpoints) != 2 or len(self.plan.sets) != 1):
            raise UsageError("compares two checkpoints on the same rows: pass --model, --data-files (one set) and "
                             "--checkpoint twice (--checkpoint A.pt --checkpoint B.pt).", param="stop_when_decided")
        if self.model is not None and not os.path.exists(self.model) and not is_hub_id(self.model):
            raise UsageError(f"--model {self.model}: no such folder, nor a hub id (org/name). Pass a folder saved "
                             "with save_pretrained(), or a hub id.")
        if self.model is not None and self.demo_family is not None:
            raise UsageError("only for the built-in demo (no --model).", param="demo_family", value=self.demo_family)

    def _check_label_words(self) -> None:
        """--label-words replaces the classifier head: no --head, and one word per class."""
        words = self.settings.label_words
        if words is None:
            return
        if self.head is not None:
            raise UsageError("not used with --label-words: the language model's head scores the label words. "
                             "Drop --head.", param="head", value=self.head)
        if self.num_labels is not None and self.num_labels != len(words):
            raise UsageError(f"{len(words)} words given, one per class, but --num-labels is {self.num_labels}. "
                             f"Give {self.num_labels} words (in class-id order) or drop --num-labels.",
                             param="label_words", value=list(words))

    def _plan(self) -> None:
        """``plan``: the (checkpoint, set) pairs to evaluate (:mod:`dist_eval.plan`); None for the demo."""
        self.plan = None
        if self.data_files is not None:
            self.plan = parse_plan(self.data_files, self.checkpoint)
        elif parse_checkpoints(self.checkpoint)[0].name:
            raise UsageError("several or named checkpoints need --model and --data-files (the built-in demo has "
                             "its own).", param="checkpoint")

    @property
    def is_demo(self) -> bool:
        return self.model is None

    def load_options(self, **decided) -> LoadOptions:
        """The model-loading flags as ``load_model``'s options (:data:`LOADING_FLAGS`, each its field of the same
        name), with what the run decided beside them (``decided``: a pair's checkpoint, the job's head and label
        words, the swarm's address, the tokenizer). The run's own local swarm is audited only when asked: its
        servers are this run's.
        """
        flags = {name: getattr(self, name) for name in LOADING_FLAGS}
        if self.audit is None and not self.initial_peers:
            flags["audit"] = 0.0
        return LoadOptions.of(None, {**flags, **decided}, caller="EvalConfig.load_options")


# the flags that load_model takes as they are (LoadOptions' fields of the same name); its other options are the run's
# to decide (EvalConfig.load_options)
LOADING_FLAGS = ("tuning_mode", "pre_seq_len", "num_labels", "swarm_timeout", "device", "stream_blocks", "audit",
                 "servers_started_from_4x_config")


def run_fields() -> list:
    """The fields of :class:`EvalConfig` that are flags of a CLI run alone (not shared with the API)."""
    return [f for f in fields(EvalConfig) if not f.metadata.get("shared")]


def flag_fields() -> Dict[str, list]:
    """Every flag's field, by group (the run's own, then :class:`Settings`, then :class:`Options`)."""
    return {"the run": run_fields(), "what decides the results": list(fields(Settings)),
            "what changes no result": list(fields(Options))}


def default_of(f) -> Any:
    """A field's default (None for one built by a factory)."""
    return None if f.default is MISSING else f.default


def settings_from(keywords: Dict[str, Any], settings: Optional[Settings] = None,
                  options: Optional[Options] = None) -> Tuple[Settings, Options]:
    """The API's settings: ``settings``/``options`` as given (the CLI passes its validated
    ones through), else built from the keywords named like their fields. A keyword that is
    no setting is a TypeError naming the closest one.
    """
    built_settings, built_options, unknown = split_settings(keywords)
    if unknown:
        import difflib

        name = sorted(unknown)[0]
        close = difflib.get_close_matches(name, [f.name for f in setting_fields()], n=1)
        raise TypeError(f"evaluate() got an unexpected keyword argument {name!r}"
                        + (f"; did you mean {close[0]!r}?" if close else ""))
    for given, built, what in ((settings, built_settings, "settings"), (options, built_options, "options")):
        passed = [f.name for f in fields(built) if f.name in keywords]
        if given is not None and passed:
            raise UsageError(f"{passed[0]!r} is given both as a keyword and in {what}=; pass one of them.",
                             param=passed[0], value=keywords[passed[0]])
    settings, options = settings or built_settings, options or built_options
    settings.check_stop_flags()
    check_not_with_stopping(settings, options)
    return settings, options


# the options a run that stops early refuses: (option, why, what else to drop)
_NOT_WITH_STOPPING = (
    ("shard", "a run that stops early decides after each round over the rows of every shard, so it cannot be "
              "split into shards launched apart", "(the shard evaluates its whole part), or drop the shard"),
    ("cluster_by", "the stopping rules take rows as independent, and the rows of one cluster are not: expected "
                   "without {0} and {1}", "(evaluate every row), or drop the clusters"),
)


def check_not_with_stopping(settings: Settings, options: Options) -> None:
    """A shard, or clusters, with a stopping rule are refused in one line naming both."""
    for name, why, fix in _NOT_WITH_STOPPING:
        value = getattr(options, name)
        if value is not None and settings.stops_early:
            raise UsageError(f"{why}. Drop {{0}} and {{1}} {fix}.", param=name, value=value,
                             names=("stop_at_width", "stop_when_decided"))


def with_setting_keywords(fn):
    """``fn``'s signature (``help(fn)``, ``inspect.signature``) lists every setting of
    :class:`Settings` and :class:`Options` as a keyword-only argument in place of its
    ``**settings_keywords``, and its docstring lists their help: both from the declarations.
    """
    import inspect

    signature = inspect.signature(fn)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default_of(f), annotation=f.type)
              for f in setting_fields()]
    fn.__signature__ = signature.replace(parameters=[*own, *shared])
    # the help is argparse's, where a percent sign is written %%
    lines = [f"    ``{f.name}`` (default ``{default_of(f)!r}``): {f.metadata['help'].replace('%%', '%')}"
             for f in setting_fields()]
    heading = "\n    Settings (keywords; or ``settings=``/``options=``, validated objects):\n\n"
    fn.__doc__ = (fn.__doc__ or "") + heading + "\n".join(lines) + "\n"
    return fn
