"""The classifier interface: :class:`LoadedModel` (a :class:`~dist_eval.backends.base.Backend` and the
facts the report needs) and :func:`load_model`.

``load_model`` reads the model folder's config (its ``model_type`` picks the family,
:mod:`dist_eval.backends.families`), the trained prompts and head (a checkpoint, or the
head saved in the folder), checks them against each other, and hands them to a backend
of :data:`dist_eval.backends.kinds.BACKENDS`. A head that would be initialised at random is refused: each rank
would draw a different one and disagree silently.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from dist_eval import ranks
from dist_eval.backends.arguments import LoadOptions, audit_share, read_label_words
from dist_eval.backends.base import Backend
from dist_eval.backends.checkpoint import (
    TrainableState,
    load_checkpoint,
    load_head,
    load_prompts,
    model_dir_trainable_state,
)
from dist_eval.backends.families import Family, family_of
from dist_eval.backends.kinds import backend_kind
from dist_eval.backends.zeroshot import LabelWords, check_lm_head, label_word_tokens
from dist_eval.errors import UsageError, param_name, warn


@dataclass(frozen=True)
class TrainableSource:
    """How :func:`load_model` read a model's prompts + head, less the checkpoint file: another
    checkpoint of the same run is read the same way (:meth:`TrainableSource.read`).
    """

    model_dir: str
    head: Optional[str] = None
    tuning_mode: Optional[str] = None
    pre_seq_len: int = 0
    num_labels: Optional[int] = None
    label_words: Optional[tuple] = None

    def read(self, checkpoint: Optional[str]) -> TrainableState:
        """``checkpoint``'s prompts + head, read and checked as :func:`load_model` read the first's."""
        return read_trainable(self.model_dir, checkpoint, self.head, self.tuning_mode, self.pre_seq_len,
                              self.num_labels, self.label_words)


@dataclass
class LoadedModel:
    """A ready-to-run classifier and the facts the report needs about it."""

    module: Backend  # called as module(input_ids) -> logits
    num_labels: int
    pad_token_id: int
    backend: str
    id2label: Optional[dict] = None
    prompt_tokens: int = 0  # prompt vectors prepended to every row (servers compute them too)
    tuning_mode: Optional[str] = None
    label_words: Optional[tuple] = None  # zero-shot: the words scored for the classes (else a classifier head)
    appended_tokens: int = 0  # zero-shot: the most label-word tokens a forward appends to a row
    attention_window: int = 0  # a sliding attention window's positions (config.json); 0: none
    attention_limit: str = "sliding attention window"  # what attention_window is, as a refused row is told
    # what decides the logits, for the row store (dist_eval.rowstore): {"model": ..., "trainable": digest}
    identity: Optional[dict] = None
    checkpoint: Optional[str] = None  # the file whose prompts + head it holds (load_model's, then load_trainable's)
    source: Optional[TrainableSource] = None  # how load_model read them (swap_checkpoint reads another that way)

    def __post_init__(self) -> None:
        if not isinstance(self.module, Backend):  # the run calls close(), provenance(), ... on it
            raise UsageError(
                f"expected a dist_eval.backends.base.Backend (forward(input_ids) -> logits, close(), provenance(), "
                f"...), got {type(self.module).__name__}. Derive its class from Backend (its docstring shows a "
                "minimal one), or pass the callable to evaluate() itself, without a LoadedModel.",
                param="module",
            )

    def check_structure(self, state: TrainableState, checkpoint: Optional[str]) -> None:
        """``state`` (another checkpoint's) fits this loaded model: same tuning mode, prompt
        vectors and classes; else a UsageError naming ``--checkpoint``.
        """
        have = (self.tuning_mode, self.prompt_tokens, self.num_labels)
        got = (state.tuning_mode, state.pre_seq_len, state.num_labels)
        if got != have:
            def describe(mode, prompts, classes):
                return f"tuning mode {mode or 'none'}, {prompts} prompt vector(s), {classes} classes"

            raise UsageError(
                f"{describe(*got)}, but the model is loaded for {describe(*have)} (the first --checkpoint). "
                "The checkpoints of one run share one loaded model: evaluate this one in another run.",
                param="checkpoint", value=checkpoint,
            )

    def load_trainable(self, state: TrainableState, checkpoint: Optional[str] = None) -> None:
        """Swap in another checkpoint's prompts + head (read with :func:`read_trainable`), in
        place: the base model stays loaded and a petals client stays connected. The logits
        are then those of a model loaded with that checkpoint, bit for bit.
        """
        self.check_structure(state, checkpoint)
        self.module.load_trainable(state)
        self.checkpoint = checkpoint
        if self.identity is not None:
            from dist_eval.backends.provenance import tensors_digest

            self.identity = {**self.identity, "trainable": tensors_digest(state.tensors)}

    def provenance(self) -> Optional[dict]:
        """The swarm's servers that computed the logits, for the report; None where no swarm is used."""
        return self.module.provenance()

    def close(self) -> None:
        """Release what the backend holds (the petals client's DHT and routing thread)."""
        self.module.close()


def load_model(backend: str, model_dir: str, options: Optional[LoadOptions] = None, **keywords) -> LoadedModel:
    """Load the classifier for ``backend`` ('petals' or 'local') with the trained prompts/head.

    The keywords (each a field of :class:`~dist_eval.backends.arguments.LoadOptions`, with its default; or
    ``options``, a LoadOptions, with keywords set on it): ``checkpoint``, ``head``, ``tuning_mode``,
    ``pre_seq_len``, ``num_labels`` (the trained prompts and head); ``initial_peers``, ``dht_prefix``,
    ``petals_client_options``, ``swarm_timeout`` (60 s), ``audit``, ``servers_started_from_4x_config`` (the
    swarm); ``device`` (cpu), ``stream_blocks`` (the local backend); ``label_words``, ``tokenizer``
    (zero-shot); ``revision``, ``fetch_whole_model`` (a hub id). A keyword that is none of them is a
    TypeError naming the closest one.

    ``device`` (local backend): cpu, cuda (this rank on cuda:LOCAL_RANK % device_count) or cuda:K.
    ``head``: the classifier head of a ``checkpoint`` that holds only prompts (petals issue
    #268's export), or without a ``checkpoint`` the head alone (a causal LM folder, as GLM-4.5's,
    whose family has no ``*ForSequenceClassification`` saves): a file with ``score.weight``, or a
    model folder holding a trained one.

    ``label_words`` (zero-shot; one word per class in class-id order, or ``"@FILE"`` with one
    per line): the model folder's causal LM scores each class by the log-probability of its
    word after the text (:mod:`dist_eval.backends.zeroshot`; ``tokenizer``, by default the
    folder's, gives the words' tokens). No head is needed; a ``checkpoint``'s prompts are used,
    a head in it is not (one line says so).

    ``model_dir`` may be a hub id (``org/name``, at ``revision``) with the petals backend and
    ``initial_peers``: only the client's files are fetched (:mod:`dist_eval.backends.hub`), and
    ``dht_prefix`` defaults to petals' own for that id. The local backend reads every block:
    on a hub id it is refused, saying how much that is, unless ``fetch_whole_model`` or ``stream_blocks``.

    ``stream_blocks`` (local): the blocks stay in the model's files, each read when the forward reaches it and
    freed after (:mod:`dist_eval.backends.streamed`): the same logits bit for bit, in the memory of one block;
    on a hub id, each block's shards are fetched when it first runs, not before.

    ``audit`` (petals): the share of forwards replayed on other servers and compared
    (:mod:`dist_eval.backends.petals.audit`); None: ``$DIST_EVAL_AUDIT``, else 3%; 0: none.
    ``servers_started_from_4x_config`` (petals): the swarm's stock petals servers read a copy of the folder
    whose config.json is in transformers 4.x's form; without it a folder saved by transformers 5.x is
    refused on such servers, which read its RoPE wrong (:mod:`dist_eval.backends.config_json`).
    """
    from dist_eval.backends.hub import hub_source, resolve_model

    o = LoadOptions.of(options, keywords)
    kind = backend_kind(backend)
    if o.stream_blocks:
        kind = kind.with_blocks_streamed()
    audit = audit_share(o.audit) if kind.on_swarm else o.audit
    model_dir, hub_prefix = resolve_model(model_dir, backend, o.initial_peers, o.revision, whole=o.fetch_whole_model,
                                          stream=o.stream_blocks)
    dht_prefix = o.dht_prefix or hub_prefix
    device = _rank_device(kind, o.device)
    config = _read_config(model_dir)
    family = family_of(config, model_dir)
    words = read_label_words(o.label_words)
    state = _resolve_trainable(model_dir, (o.checkpoint, o.head), (o.tuning_mode, o.pre_seq_len), o.num_labels,
                               family, words)
    _check_shapes(state, config, o.checkpoint, model_dir)
    _check_computed_here(family, config, state)
    _check_weights_read_here(kind, family, config, backend)
    _check_pad_token(config, model_dir)
    scored = _label_words(model_dir, config, family, words, o.tokenizer) if words else None
    module = kind.load(model_dir, state, family, scored, initial_peers=o.initial_peers, dht_prefix=dht_prefix,
                       client_options=o.petals_client_options or {}, swarm_timeout=o.swarm_timeout, device=device,
                       hub=hub_source(model_dir), audit_share=audit or 0.0,
                       servers_started_from_4x_config=o.servers_started_from_4x_config)
    module.eval()
    return LoadedModel(module, state.num_labels, int(config.pad_token_id), backend,
                       class_names(config, state.num_labels), state.pre_seq_len, state.tuning_mode,
                       label_words=words, appended_tokens=scored.appended_tokens if scored else 0,
                       attention_window=family.attention_window(config),
                       attention_limit=family.attention_limit(config),
                       identity=_identity(model_dir, config, state, family, (backend, device, dht_prefix)),
                       checkpoint=o.checkpoint,
                       source=TrainableSource(model_dir, o.head, o.tuning_mode, o.pre_seq_len, o.num_labels, words))


def _rank_device(kind, device: str) -> str:
    """The device this rank computes on (``device``: cpu, cuda or cuda:K); refused for a backend that does not
    compute here (a Petals client stays on the CPU).
    """
    if device == "cpu":
        return device
    from dist_eval.ranks.devices import this_rank_device

    if not kind.computes_here:
        raise UsageError("only the local backend computes here; a Petals client stays on the CPU.",
                         param="device", value=device)
    return this_rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))


def _check_pad_token(config, model_dir: str) -> None:
    """Right-padded batches find each sequence's last token by the pad token: config.json must name one."""
    if config.pad_token_id is None:
        raise UsageError(
            "config.json has no pad_token_id; right-padded batches need one to find "
            "each sequence's last token. Set pad_token_id in config.json.",
            param="model_dir", value=model_dir,
        )


def _identity(model_dir: str, config, state: TrainableState, family: Family, where: tuple) -> dict:
    """What decides this model's logits besides the rows (the row store's key: dist_eval.rowstore);
    ``where``: (backend, device, dht_prefix). The fields of config.json read from transformers 5.x's
    form and the family defaults filled in are in it (the same bytes read another way before: those rows are not
    served again).
    """
    from dist_eval.backends.config_json import config_reading
    from dist_eval.backends.provenance import folder_identity, tensors_digest

    backend, device, dht_prefix = where
    model = {"folder": folder_identity(model_dir), "family": family.model_type, "backend": backend,
             "device": str(device).split(":")[0], "dtype": "float32", "dht_prefix": dht_prefix,
             **config_reading(config)}
    revision = family.computation_revision(config)
    if revision:  # absent for the others: their stored rows' keys unchanged
        model["computation"] = revision
    return {"model": model, "trainable": tensors_digest(state.tensors)}


def _label_words(model_dir: str, config, family: Family, words: tuple, tokenizer) -> LabelWords:
    """The label words' tokens, once the folder is known to hold an LM head."""
    check_lm_head(model_dir, config, family)
    if tokenizer is None:
        from dist_eval.backends.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)  # the label words' tokens
    return label_word_tokens(tokenizer, words, int(config.pad_token_id))


def read_trainable(
    model_dir: str, checkpoint: Optional[str] = None, head: Optional[str] = None, tuning_mode: Optional[str] = None,
    pre_seq_len: int = 0, num_labels: Optional[int] = None, label_words: Union[Sequence[str], str, None] = None,
) -> TrainableState:
    """The prompts + head :func:`load_model` would load for these arguments, checked the same
    way, without loading the model (for :meth:`LoadedModel.load_trainable`).
    """
    config = _read_config(model_dir)
    family = family_of(config, model_dir)
    state = _resolve_trainable(model_dir, (checkpoint, head), (tuning_mode, pre_seq_len), num_labels, family,
                               read_label_words(label_words))
    _check_shapes(state, config, checkpoint, model_dir)
    return state


def swap_checkpoint(model: LoadedModel, checkpoint: Optional[str]) -> None:
    """``model`` (from :func:`load_model`) holds ``checkpoint``'s prompts + head from now on: read and
    checked as :func:`load_model` read the first (``model.source``), swapped in place
    (:meth:`LoadedModel.load_trainable`), in the phase "loading the checkpoint" (every rank); nothing
    is read when the model holds that checkpoint already.
    """
    if checkpoint == model.checkpoint:
        return
    if model.source is None:
        raise UsageError("this model was not made by load_model, so how to read another checkpoint for it is not "
                         "known. Load it with dist_eval.load_model(..., checkpoint=...) instead.",
                         param="model", value=type(model.module).__name__)
    with ranks.phase("loading the checkpoint"):
        model.load_trainable(model.source.read(checkpoint), checkpoint)


def _read_config(model_dir: str):
    from transformers import AutoConfig

    from dist_eval.backends.blocks import family_class, register
    from dist_eval.backends.compat import heads_read_after
    from dist_eval.backends.config_json import family_of_folder
    from dist_eval.backends.peft_adapter import refuse_as_model

    refuse_as_model(model_dir)  # a file, or a PEFT adapter's folder, named as what it is
    if not os.path.isdir(model_dir):
        raise UsageError(
            "not a folder. Pass a folder saved with save_pretrained().", param="model_dir", value=model_dir
        )
    family = family_of_folder(model_dir)  # what no block here computes is refused from config.json itself
    register()  # the config classes of the families the pinned transformers lacks
    try:
        if family.built_on:  # the config class built here, also where a later transformers has one of the name
            with heads_read_after():  # a family's other model_type read as the family: no note of another type
                return family_class(family.local_class, in_petals=False).config_class.from_pretrained(model_dir)
        return AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # a folder without a readable config.json
        raise UsageError(
            f"cannot read its config.json ({e}). Pass a folder saved with save_pretrained().",
            param="model_dir",
            value=model_dir,
        ) from e


def class_names(config, num_labels: int) -> Optional[dict]:
    """config.json's id2label, unless it is transformers' placeholder map (LABEL_0, ...)."""
    id2label = getattr(config, "id2label", None)
    if id2label and (
        len(id2label) != num_labels
        or all(str(id2label.get(i, id2label.get(str(i)))) == f"LABEL_{i}" for i in range(num_labels))
    ):
        return None
    return id2label


def _resolve_trainable(model_dir: str, files, tuning, num_labels, family, label_words=None) -> TrainableState:
    """The prompts + head every rank will use (``files``: checkpoint, head; ``tuning``: mode,
    prompt count); refuses anything random. With ``label_words``: the prompts only.
    """
    checkpoint, head = files
    if label_words is not None:
        state = _zero_shot_state(checkpoint, head, family, label_words, num_labels)
    elif checkpoint:
        state = load_checkpoint(checkpoint, family, head)
    elif head:  # the head alone (no prompts), e.g. for a causal LM folder
        state = load_head(head, family)
    else:
        state = model_dir_trainable_state(model_dir)
        if state is None:
            raise UsageError(
                f"the model folder has no classifier head ('{family.head}.weight') and no "
                "--checkpoint was given; its head would be initialised at random, differently on each "
                "rank. Pass --checkpoint FILE with the trained prompts and head, or score the classes "
                "zero-shot with --label-words.",
                param="model_dir",
                value=model_dir,
            )
    _check_tuning(state, *tuning)
    if num_labels is not None and num_labels != state.num_labels:
        raise UsageError(
            f"the classifier head has {state.num_labels} outputs. "
            f"Pass {param_name('num_labels', state.num_labels)} or the checkpoint trained for {num_labels} labels.",
            param="num_labels",
            value=num_labels,
        )
    return state


def _zero_shot_state(checkpoint, head, family: Family, label_words: tuple, num_labels) -> TrainableState:
    """The prompts of ``checkpoint`` (or none) for a model scoring ``label_words``."""
    if head:
        raise UsageError("not used with label words: the language model's head scores them. Drop it.",
                         param="head", value=head)
    if num_labels is not None and num_labels != len(label_words):
        raise UsageError(f"{len(label_words)} words given, one per class, but num_labels is {num_labels}. "
                         f"Give {num_labels} words (in class-id order).", param="label_words",
                         value=list(label_words))
    if not checkpoint:
        return TrainableState(None, 0, len(label_words), {})
    state, had_head = load_prompts(checkpoint, family, len(label_words))
    if had_head and ranks.get_rank() == 0:
        warn(f"{param_name('checkpoint', checkpoint)}: its classifier head is not used (the language model's head "
             "scores the label words); its prompts are.")
    return state


def _check_tuning(state: TrainableState, tuning_mode, pre_seq_len) -> None:
    """The tuning mode and prompt count asked for are the checkpoint's (None: read from it)."""
    if tuning_mode is None:
        tuning_mode = state.tuning_mode
        pre_seq_len = pre_seq_len or state.pre_seq_len
    if tuning_mode != state.tuning_mode:
        raise UsageError(
            f"the checkpoint was trained with tuning mode {state.tuning_mode!r}. "
            f"Pass {param_name('tuning_mode', state.tuning_mode or 'none')} or another checkpoint.",
            param="tuning_mode",
            value=tuning_mode,
        )
    if tuning_mode and pre_seq_len != state.pre_seq_len:
        raise UsageError(
            f"the checkpoint holds {state.pre_seq_len} prompt vectors. "
            f"Pass {param_name('pre_seq_len', state.pre_seq_len)}.",
            param="pre_seq_len",
            value=pre_seq_len,
        )


def _check_computed_here(family: Family, config, state: TrainableState) -> None:
    """Refuse, before any weight is read, prompts the family's blocks cannot take (DeepSeek-V4's hash routing)."""
    why = family.prompts_refusal(config, state.tuning_mode)
    if why:
        raise UsageError(why + ".", param="tuning_mode", value=state.tuning_mode)


def _check_weights_read_here(kind, family: Family, config, backend: str) -> None:
    """Refuse FP8 weights where nothing here dequantizes them: the blocks of a backend without a swarm (local,
    streamed) of a family whose blocks are not dist_eval's own layers, which read them as they are, without their
    scales (other logits, no error). dist_eval's servers dequantize them for every family, own layers on load.
    """
    from dist_eval.backends.blocks import has_own_layers
    from dist_eval.backends.layers import fp8_block_size

    if kind.on_swarm or has_own_layers(family) or fp8_block_size(config) is None:
        return
    raise UsageError(f"FP8 weights (quantization_config quant_method 'fp8' in config.json): the {family.model_type} "
                     "blocks of a backend without a swarm read them without their scales. Run them on a swarm, whose "
                     "servers dequantize them (--backend petals), or pass a dequantized copy of the folder.",
                     param="backend", value=backend)


def _check_shapes(state: TrainableState, config, checkpoint: Optional[str], model_dir: str) -> None:
    if state.adapter is not None:  # a PEFT adapter: its config's base model, hidden size and layers
        from dist_eval.backends.peft_adapter import check_base

        check_base(state.adapter, config, model_dir)
    expected = {"score.weight": (state.num_labels, config.hidden_size)} if "score.weight" in state.tensors else {}
    if state.tuning_mode:
        expected["prompt_embeddings.weight"] = (state.pre_seq_len, config.hidden_size)
    if state.tuning_mode == "deep_ptune":
        expected["intermediate_prompt_embeddings.weight"] = (
            state.pre_seq_len,
            config.num_hidden_layers * config.hidden_size,
        )
    for key, shape in expected.items():
        got = tuple(state.tensors[key].shape)
        if got != shape:
            raise UsageError(
                f"{key} has shape {list(got)}, expected {list(shape)} for this model "
                f"(hidden size {config.hidden_size}, {config.num_hidden_layers} layers). The checkpoint was "
                "trained for another model; pass the matching --model or --checkpoint.",
                param="checkpoint",
                value=checkpoint or model_dir,
            )


@contextlib.contextmanager
def model_files_readable(model_dir: str):
    """A file of the model folder that cannot be read (a truncated safetensors file, one
    missing) is the user's input to fix: a usage error (exit 2), not an internal one. Whatever
    failed, a JSON file of the folder that does not parse is named (:func:`~dist_eval.backends.tokenizer.
    refuse_broken_json`).
    """
    from json import JSONDecodeError

    from safetensors import SafetensorError

    from dist_eval.backends.tokenizer import refuse_broken_json
    from dist_eval.errors import short_error

    try:
        yield
    except UsageError:
        raise
    except Exception as e:
        refuse_broken_json(model_dir, cause=e)
        if not isinstance(e, (SafetensorError, JSONDecodeError, FileNotFoundError, IsADirectoryError, PermissionError)):
            raise
        raise UsageError(f"a file of the folder cannot be read ({short_error(e, 120)}): it is broken or incomplete. "
                         "Save or copy the model again.", param="model_dir", value=model_dir) from e
