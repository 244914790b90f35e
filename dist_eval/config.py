"""The run's settings: one dataclass, validated on construction, with help per field.

The CLI is generated from these fields (``--batch-size`` <-> ``batch_size``), so the
flags, their help and their checks cannot drift apart.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import List, Optional

from dist_eval.errors import UsageError
from dist_eval.data import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS
from dist_eval.predict import DEFAULT_IN_FLIGHT


def _opt(help: str, **kwargs):
    return field(metadata={"help": help, **kwargs.pop("meta", {})}, **kwargs)


@dataclass
class EvalConfig:
    model: Optional[str] = _opt("Folder saved with save_pretrained (config, weights, tokenizer). Omit with --data-files for the built-in demo.", default=None)
    data_files: Optional[List[str]] = _opt("Data: csv/tsv/json/jsonl/parquet files, a save_to_disk folder, or a hub dataset name.", default=None, meta={"nargs": "+"})
    split: Optional[str] = _opt("Split to evaluate (needed for a save_to_disk DatasetDict; loose files are one split).", default=None)
    text_column: str = _opt("Column with the input text.", default="text")
    text_pair_column: Optional[str] = _opt("Optional second text column (sentence pairs).", default=None)
    label_column: str = _opt("Column with integer class ids in [0, num_labels).", default="label")
    num_labels: Optional[int] = _opt("Number of classes; must match the classifier head (read from the checkpoint by default).", default=None)
    backend: str = _opt("petals: blocks run on a swarm; local: the same model in-process (the reference).", default="petals", meta={"choices": ["petals", "local"]})
    initial_peers: Optional[List[str]] = _opt("Swarm multiaddrs. Omitted with --backend petals: a local swarm serving --model is started for the run.", default=None, meta={"nargs": "+"})
    dht_prefix: Optional[str] = _opt("DHT prefix the swarm's servers announce the model under.", default=None)
    checkpoint: Optional[str] = _opt("Trained prompt embeddings + classifier head (dist_eval or Petals state dict).", default=None)
    tuning_mode: Optional[str] = _opt("Prompt tuning mode of the checkpoint (read from it by default).", default=None, meta={"choices": ["ptune", "deep_ptune"]})
    pre_seq_len: int = _opt("Number of prompt vectors (needs --tuning-mode; read from the checkpoint by default).", default=0)
    batch_size: int = _opt("At most this many rows per forward pass.", default=DEFAULT_BATCH_SIZE)
    max_length: int = _opt("Longer texts are truncated to this many tokens (counted in the report).", default=512)
    max_batch_tokens: int = _opt("And at most this many padded tokens per forward: rows x (longest row + prompt vectors); 0: no cap. Keep it under the servers' --max_batch_size (2048 by default).", default=DEFAULT_MAX_BATCH_TOKENS)
    length_buckets: bool = _opt("Batch rows of similar token length together (less padding; results unchanged).", default=True)
    resume: bool = _opt("Reuse the partial results an interrupted run of the same model, data and settings stored in --output-dir.", default=True)
    save_interval: float = _opt("Seconds between each rank's atomic saves of finished batches (partial results; 0: every batch).", default=10.0)
    in_flight: int = _opt("Batches in flight at once on each rank (overlaps network waits; results unchanged).", default=DEFAULT_IN_FLIGHT)
    save_logits: bool = _opt("Also write each row's logits to predictions.jsonl.", default=False)
    output_dir: str = _opt("Where metrics.json and predictions.jsonl go.", default="dist_eval_output")
    local_servers: int = _opt("Servers of the local swarm started when --initial-peers is omitted.", default=2)
    swarm_timeout: float = _opt("Seconds to wait for the swarm to serve every block before failing; also how long a batch is retried when every server of some block fails mid-run.", default=60.0)
    dist_timeout: float = _opt("Seconds a collective may wait for the other ranks before failing.", default=900.0)
    quiet: bool = _opt("Print only errors and the final one-line result.", default=False)
    progress: str = _opt("Progress of all ranks, on stderr from rank 0: bar, log (plain lines for job logs), none; auto = bar on a terminal, else log (none with --quiet).", default="auto", meta={"choices": ["auto", "bar", "log", "none"]})
    bootstrap_resamples: int = _opt("Resamples of the bootstrap confidence intervals (level 0.95) of accuracy, macro-F1 and loss (0 disables).", default=1000)
    bootstrap_seed: int = _opt("Seed of the bootstrap: the same seed gives the same intervals.", default=0)
    report_to: str = _opt("Also log the final metrics and confusion matrix to wandb or tensorboard (its package must be installed).", default="none", meta={"choices": ["none", "wandb", "tensorboard"]})

    def __post_init__(self) -> None:
        if (self.model is None) != (self.data_files is None):
            given, missing = ("--model", "--data-files") if self.model else ("--data-files", "--model")
            raise UsageError(f"{missing}: needed with {given} (or omit both to run the built-in demo).")
        for name in ("batch_size", "max_length", "local_servers", "in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} {value}: expected a positive integer.")
        for name in ("swarm_timeout", "dist_timeout"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected a positive number of seconds.")
        if self.save_interval < 0:
            raise UsageError(f"--save-interval {self.save_interval}: expected a number of seconds >= 0.")
        if self.max_batch_tokens < 0:
            raise UsageError(f"--max-batch-tokens {self.max_batch_tokens}: expected a number of tokens >= 0 (0: no cap).")
        if self.num_labels is not None and self.num_labels < 2:
            raise UsageError(f"--num-labels {self.num_labels}: expected at least 2 classes.")
        if self.pre_seq_len < 0:
            raise UsageError(f"--pre-seq-len {self.pre_seq_len}: expected >= 0.")
        if self.pre_seq_len and not self.tuning_mode:
            raise UsageError(f"--pre-seq-len {self.pre_seq_len}: needs --tuning-mode ptune or deep_ptune.")
        if self.initial_peers and self.backend != "petals":
            raise UsageError("--initial-peers: only used with --backend petals.")
        if not isinstance(self.bootstrap_resamples, int) or self.bootstrap_resamples < 0:
            raise UsageError(f"--bootstrap-resamples {self.bootstrap_resamples}: expected an integer >= 0 (0 disables the intervals).")
        if not isinstance(self.bootstrap_seed, int) or self.bootstrap_seed < 0:
            raise UsageError(f"--bootstrap-seed {self.bootstrap_seed}: expected an integer >= 0.")
        from dist_eval.tracking import check_tracker

        check_tracker(self.report_to)  # a missing wandb/tensorboard fails here, before any work
        if self.model is not None and not os.path.isdir(self.model):
            raise UsageError(f"--model {self.model}: no such folder. Pass a folder saved with save_pretrained().")

    @property
    def is_demo(self) -> bool:
        return self.model is None


def config_fields():
    return fields(EvalConfig)
