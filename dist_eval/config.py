"""Every setting of a run and its default, each defined and checked once.

- :class:`Settings`: what decides each row's logits (the data's columns and the batch
  plan). The Python API takes them as arguments of ``evaluate`` and builds this object;
  the resume key is a hash of all its fields, so a new setting cannot be left out of it.
- :class:`Options`: what changes no result (batches in flight, saving, the bootstrap).
- :class:`EvalConfig`: the CLI's settings. The flags are generated from its fields
  (``--batch-size`` <-> ``batch_size``), so the flags, their help and their checks
  cannot drift apart; it holds a :class:`Settings` and an :class:`Options`.

A :class:`~dist_eval.errors.UsageError` raised here names the parameter: the API shows
it as ``batch_size=0``, the CLI as ``--batch-size 0``.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import List, Optional, Sequence, Tuple, Union

from dist_eval.errors import UsageError
from dist_eval.swarm.devices import DEVICE_REQUEST

# Defaults chosen from benchmarks/RESULTS.md: on a swarm, fewer and bigger forwards win
# (each one pays a round trip and per-request work on every server), and a token cap
# keeps a batch of long rows within a Petals server's --max_batch_size (2048 tokens by
# default, prompt vectors included) while rows of similar length fill it. A batch goes
# to the swarm as one request (backends/requests.py), so the cap is the request size.
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_BATCH_TOKENS = 2048
DEFAULT_MAX_LENGTH = 512
# Batches in flight per rank: 2 overlaps one batch's network wait with the next one's
# work; more gains little on a small swarm (benchmarks/RESULTS.md).
DEFAULT_IN_FLIGHT = 2
DEFAULT_SAVE_INTERVAL = 10.0
DEFAULT_BOOTSTRAP_RESAMPLES = 1000
DEFAULT_SWARM_TIMEOUT = 60.0


def check_int(param: str, value, minimum: int, expected: str = "a positive integer") -> None:
    """``value`` must be an int >= ``minimum``."""
    if not isinstance(value, int) or value < minimum:
        raise UsageError(f"expected {expected}.", param=param, value=value)


def check_seconds(param: str, value, *, allow_zero: bool = False) -> None:
    """A number of seconds: > 0, or >= 0 with ``allow_zero``."""
    if value < 0 or (value == 0 and not allow_zero):
        expected = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        raise UsageError(f"expected {expected}.", param=param, value=value)


def read_label_words(value: Union[str, Sequence[str], None], param: str = "label_words") -> Optional[Tuple[str, ...]]:
    """The label words (one per class, in class-id order) as a tuple; None stays None.

    ``value``: the words, or ``"@PATH"`` (alone), a UTF-8 file with one word per line
    (surrounding whitespace stripped, blank lines skipped). At least 2 distinct, non-empty words.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    words = list(value)
    if len(words) == 1 and isinstance(words[0], str) and words[0].startswith("@"):
        path = words[0][1:]
        try:
            with open(path, encoding="utf-8") as f:
                words = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise UsageError(f"cannot read the file of label words ({e.strerror}). Pass @FILE with one word per "
                             "line, or the words themselves.", param=param, value=value[0]) from e
    bad = [w for w in words if not isinstance(w, str) or not w.strip()]
    if bad:
        raise UsageError(f"expected one non-empty word per class; got {bad[0]!r}.", param=param, value=words)
    words = [w.strip() for w in words]
    if len(words) < 2:
        raise UsageError(f"expected one word per class, at least 2; got {len(words)}.", param=param, value=words)
    repeated = sorted({w for w in words if words.count(w) > 1})
    if repeated:
        raise UsageError(f"{repeated} given for more than one class; each class needs its own word.",
                         param=param, value=words)
    return tuple(words)


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


@dataclass(frozen=True)
class Settings:
    """What decides which rows are evaluated and each row's logits. Every field is part of
    the resume key.
    """

    text_column: str = "text"
    text_pair_column: Optional[str] = None
    label_column: str = "label"
    batch_size: int = DEFAULT_BATCH_SIZE
    max_length: int = DEFAULT_MAX_LENGTH
    length_buckets: bool = True
    max_batch_tokens: Optional[int] = DEFAULT_MAX_BATCH_TOKENS  # None: no cap
    limit: int = 0  # a seeded random sample of this many rows (dist_eval.data.sample); 0: every row
    limit_seed: int = 0
    # zero-shot (dist_eval.backends.zeroshot): the words scored for the classes, in class-id order
    label_words: Optional[Tuple[str, ...]] = None
    template: Optional[str] = None  # each row's text is "{text}" in it (and "{text_pair}") before tokenizing

    def __post_init__(self) -> None:
        object.__setattr__(self, "label_words", read_label_words(self.label_words))
        check_template(self.template, self.text_pair_column)
        check_int("batch_size", self.batch_size, 1)
        check_int("limit", self.limit, 0, "an integer >= 0 (0: every row)")
        check_int("limit_seed", self.limit_seed, 0, "an integer >= 0")
        check_int("max_length", self.max_length, 1)
        if self.max_batch_tokens is not None:
            check_int("max_batch_tokens", self.max_batch_tokens, 1, "a positive number of tokens (None: no cap)")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Options:
    """What changes no result: throughput, saving partial results, the bootstrap."""

    in_flight: int = DEFAULT_IN_FLIGHT
    save_interval: float = DEFAULT_SAVE_INTERVAL
    bootstrap_resamples: int = DEFAULT_BOOTSTRAP_RESAMPLES
    bootstrap_seed: int = 0
    top_k: Optional[int] = None  # the k of top{k}_accuracy; None: 2 with more than 2 classes, else none

    def __post_init__(self) -> None:
        check_int("in_flight", self.in_flight, 1)
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1, "a positive integer (the k of top-k accuracy)")
        check_seconds("save_interval", self.save_interval, allow_zero=True)
        check_int("bootstrap_resamples", self.bootstrap_resamples, 0, "an integer >= 0 (0 disables the intervals)")
        check_int("bootstrap_seed", self.bootstrap_seed, 0, "an integer >= 0")

    def as_dict(self) -> dict:
        return asdict(self)


def _opt(help: str, **kwargs):
    return field(metadata={"help": help, **kwargs.pop("meta", {})}, **kwargs)


_PETALS_OR_LOCAL = "petals: blocks run on a swarm; local: the same model in-process (the reference)."
_MAX_BATCH_TOKENS = (
    "And at most this many padded tokens per forward: rows x (longest row + prompt vectors); 0: no cap. "
    "A batch goes to the swarm as one request; a server that accepts fewer tokens (its --max_batch_size, "
    "2048 by default) has it split."
)
_INITIAL_PEERS = (
    "Swarm multiaddrs. Omitted with --backend petals: a local swarm serving --model is started for the run."
)
_SWARM_TIMEOUT = (
    "Seconds to wait for the swarm to serve every block before failing; also how long a batch is retried when "
    "every server of some block fails mid-run."
)
_PROGRESS = (
    "Progress of all ranks, on stderr from rank 0: bar, log (plain lines for job logs), none; "
    "auto = bar on a terminal, else log (none with --quiet)."
)


@dataclass
class EvalConfig:
    """The CLI's settings: one field per flag, validated on construction."""

    # what to evaluate
    model: Optional[str] = _opt(
        "Folder saved with save_pretrained (config, weights, tokenizer). Omit with --data-files for the built-in demo.",
        default=None,
    )
    data_files: Optional[List[str]] = _opt(
        "Data: csv/tsv/json/jsonl/parquet files, a save_to_disk folder, or a hub dataset name. Several sets in "
        "one run: NAME=FILE[,FILE...] each (e.g. dev=dev.jsonl test=a.jsonl,b.jsonl), each reported in "
        "OUTPUT_DIR/NAME.",
        default=None,
        meta={"nargs": "+"},
    )
    split: Optional[str] = _opt(
        "Split to evaluate (needed for a save_to_disk DatasetDict; loose files are one split).", default=None
    )
    text_column: str = _opt("Column with the input text.", default=Settings.text_column)
    text_pair_column: Optional[str] = _opt("Optional second text column (sentence pairs).", default=None)
    label_column: str = _opt("Column with integer class ids in [0, num_labels).", default=Settings.label_column)
    num_labels: Optional[int] = _opt(
        "Number of classes; must match the classifier head (read from the checkpoint by default).", default=None
    )
    # the model
    backend: str = _opt(_PETALS_OR_LOCAL, default="petals", meta={"choices": ["petals", "local"]})
    initial_peers: Optional[List[str]] = _opt(_INITIAL_PEERS, default=None, meta={"nargs": "+"})
    dht_prefix: Optional[str] = _opt("DHT prefix the swarm's servers announce the model under.", default=None)
    checkpoint: Optional[List[str]] = _opt(
        "Trained prompt embeddings + classifier head (dist_eval's file, a Petals state dict, or petals #268's "
        "torch.save(prompt_embeddings) with --head). Repeat it for several checkpoints of one structure, "
        "evaluated with the model loaded once, each reported in OUTPUT_DIR/NAME (NAME: the file's stem, "
        "or NAME=FILE).",
        default=None,
        meta={"action": "append"},
    )
    head: Optional[str] = _opt(
        "The classifier head of a --checkpoint that holds only prompts: a file with score.weight, or a model "
        "folder holding a trained one (e.g. the --model folder of a *ForSequenceClassification save).",
        default=None,
    )
    demo_family: Optional[str] = _opt(
        "Model family (config.json model_type) of the built-in demo (no --model): the same task on a small model "
        "of this family; a family petals serves. Default: the embedded demo's.",
        default=None,
    )
    tuning_mode: Optional[str] = _opt(
        "Prompt tuning mode of the checkpoint (read from it by default).",
        default=None,
        meta={"choices": ["ptune", "deep_ptune"]},
    )
    pre_seq_len: int = _opt(
        "Number of prompt vectors (needs --tuning-mode; read from the checkpoint by default).", default=0
    )
    label_words: Optional[List[str]] = _opt(
        "Zero-shot: score each class by the language model's log-probability of its word after the text (one "
        "word per class, in class-id order; @FILE: one word per line). No classifier head or --checkpoint is "
        "needed; a ptune --checkpoint's prompts are used (its head is not).",
        default=None,
        meta={"nargs": "+"},
    )
    template: Optional[str] = _opt(
        "Each row's text is put in this template before tokenizing, at {text} (and {text_pair} with "
        "--text-pair-column), e.g. 'Review: {text} Sentiment:'. Default: the text as it is.",
        default=None,
    )
    # batches
    batch_size: int = _opt("At most this many rows per forward pass.", default=DEFAULT_BATCH_SIZE)
    max_length: int = _opt(
        "Longer texts are truncated to this many tokens (counted in the report).", default=DEFAULT_MAX_LENGTH
    )
    max_batch_tokens: int = _opt(_MAX_BATCH_TOKENS, default=DEFAULT_MAX_BATCH_TOKENS)
    length_buckets: bool = _opt(
        "Batch rows of similar token length together (less padding; results unchanged).", default=True
    )
    limit: int = _opt(
        "Evaluate a seeded random sample of this many rows (without replacement; chosen by a hash of each row's "
        "content: the same rows for any number of ranks and any order of the files); 0: every row.",
        default=0,
    )
    limit_seed: int = _opt("Seed of the --limit sample.", default=0)
    # an interrupted run
    resume: bool = _opt(
        "Reuse the partial results an interrupted run of the same model, data and settings stored in --output-dir.",
        default=True,
    )
    save_interval: float = _opt(
        "Seconds between each rank's atomic saves of finished batches (partial results; 0: every batch).",
        default=DEFAULT_SAVE_INTERVAL,
    )
    in_flight: int = _opt(
        "Batches in flight at once on each rank (overlaps network waits; results unchanged).",
        default=DEFAULT_IN_FLIGHT,
    )
    # outputs
    save_logits: bool = _opt("Also write each row's logits to predictions.jsonl.", default=False)
    save_text: bool = _opt("Also write each row's text (and text pair) to predictions.jsonl.", default=False)
    output_dir: str = _opt("Where metrics.json and predictions.jsonl go.", default="dist_eval_output")
    # the swarm and the process group
    local_servers: Optional[int] = _opt(
        "Servers of the local swarm started when --initial-peers is omitted (default: 2 on the CPU; on GPUs "
        "as many per GPU as fit in half its memory, at most 8). Each holds every block where they all fit in "
        "half the memory; else every block is on two of them.",
        default=None,
    )
    local_device: str = _opt(
        "Where that local swarm's servers compute: auto (every visible GPU if any, else the CPU), cpu, cuda or cuda:K.",
        default="auto",
    )
    swarm_timeout: float = _opt(_SWARM_TIMEOUT, default=DEFAULT_SWARM_TIMEOUT)
    dist_timeout: float = _opt("Seconds a collective may wait for the other ranks before failing.", default=900.0)
    dist_backend: str = _opt(
        "Process group backend: gloo (any N, wherever the ranks run) or nccl (one GPU per rank).",
        default="gloo", meta={"choices": ["gloo", "nccl"]},
    )
    device: str = _opt(
        "Where --backend local computes: cpu, cuda (each rank on cuda:LOCAL_RANK %% device_count) or cuda:K.",
        default="cpu",
    )
    # what is shown
    quiet: bool = _opt("Print only errors and the final one-line result.", default=False)
    progress: str = _opt(_PROGRESS, default="auto", meta={"choices": ["auto", "bar", "log", "none"]})
    bootstrap_resamples: int = _opt(
        "Resamples of the bootstrap confidence intervals (level 0.95) of accuracy, macro-F1 and loss (0 disables).",
        default=DEFAULT_BOOTSTRAP_RESAMPLES,
    )
    bootstrap_seed: int = _opt("Seed of the bootstrap: the same seed gives the same intervals.", default=0)
    top_k: Optional[int] = _opt(
        "The k of the top-k accuracy (top{K}_accuracy in metrics.json); default: 2 with more than 2 classes, "
        "none with 2.",
        default=None,
    )
    report_to: str = _opt(
        "Also log the final metrics and confusion matrix to wandb or tensorboard (its package must be installed).",
        default="none",
        meta={"choices": ["none", "wandb", "tensorboard"]},
    )

    def __post_init__(self) -> None:
        if (self.model is None) != (self.data_files is None):
            given, missing = ("--model", "--data-files") if self.model else ("--data-files", "--model")
            raise UsageError(f"{missing}: needed with {given} (or omit both to run the built-in demo).")
        check_int("max_batch_tokens", self.max_batch_tokens, 0, "a number of tokens >= 0 (0: no cap)")
        if self.device != "cpu" and self.backend != "local":
            raise UsageError("only --backend local computes here; a Petals client's tensors stay on the CPU.",
                             param="device", value=self.device)
        # a flag's 0 is the API's None (no cap): converted here, once
        self.settings = Settings(
            text_column=self.text_column,
            text_pair_column=self.text_pair_column,
            label_column=self.label_column,
            batch_size=self.batch_size,
            max_length=self.max_length,
            length_buckets=self.length_buckets,
            max_batch_tokens=self.max_batch_tokens or None,
            limit=self.limit,
            limit_seed=self.limit_seed,
            label_words=self.label_words,
            template=self.template,
        )
        self._check_label_words()
        self.options = Options(
            in_flight=self.in_flight,
            save_interval=self.save_interval,
            bootstrap_resamples=self.bootstrap_resamples,
            bootstrap_seed=self.bootstrap_seed,
            top_k=self.top_k,
        )
        if self.local_servers is not None:
            check_int("local_servers", self.local_servers, 1)
        if not isinstance(self.local_device, str) or not DEVICE_REQUEST.fullmatch(self.local_device):
            raise UsageError("expected auto, cpu, cuda (every visible GPU) or cuda:K.", param="local_device",
                             value=self.local_device)
        check_seconds("swarm_timeout", self.swarm_timeout)
        check_seconds("dist_timeout", self.dist_timeout)
        if self.num_labels is not None:
            check_int("num_labels", self.num_labels, 2, "at least 2 classes")
        check_int("pre_seq_len", self.pre_seq_len, 0, ">= 0")
        if self.pre_seq_len and not self.tuning_mode:
            raise UsageError("needs --tuning-mode ptune or deep_ptune.", param="pre_seq_len", value=self.pre_seq_len)
        if self.initial_peers and self.backend != "petals":
            raise UsageError("--initial-peers: only used with --backend petals.")
        from dist_eval.output.tracking import check_tracker

        check_tracker(self.report_to)  # a missing wandb/tensorboard fails here, before any work
        self._plan()
        if self.model is not None and not os.path.isdir(self.model):
            raise UsageError(f"--model {self.model}: no such folder. Pass a folder saved with save_pretrained().")
        self._check_family()

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
        """``plan``: the sets x checkpoints to evaluate (:mod:`dist_eval.jobs`); None for the demo."""
        from dist_eval.jobs import parse_checkpoints, parse_plan

        self.plan = None
        if self.data_files is not None:
            self.plan = parse_plan(self.data_files, self.checkpoint)
        elif parse_checkpoints(self.checkpoint)[0].name:
            raise UsageError("several or named checkpoints need --model and --data-files (the built-in demo has "
                             "its own).", param="checkpoint")

    def _check_family(self) -> None:
        """A family petals cannot serve is refused here, before any work."""
        from dist_eval.backends.families import DEMO_FAMILY, FAMILIES, family_of_folder

        if self.model is not None:
            family_of_folder(self.model)
            if self.demo_family is not None:
                raise UsageError("only for the built-in demo (no --model).", param="demo_family",
                                 value=self.demo_family)
        elif self.demo_family is None:
            self.demo_family = DEMO_FAMILY
        elif self.demo_family not in FAMILIES:
            raise UsageError(f"expected one of {', '.join(sorted(FAMILIES))}.", param="demo_family",
                             value=self.demo_family)

    @property
    def is_demo(self) -> bool:
        return self.model is None


def config_fields():
    return fields(EvalConfig)
