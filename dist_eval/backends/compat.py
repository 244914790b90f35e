"""What dist_eval's own code needs of the installed transformers, and the third-party output it quiets.

The generation facts (:func:`configs_are_dataclasses`), installed versions (:func:`installed_version`), the
changes to transformers and torch that hold within a ``with`` block around a load (no random init of meta tensors,
the load's "newly initialized" line for heads read right after, no quantizer for a petals client's remote blocks),
and the quieting of warnings and progress bars in the processes dist_eval owns. Importing petals, and every
change dist_eval makes to petals and hivemind, is :mod:`dist_eval.backends.petals.shims`; docs/design.md ("What
dist_eval changes in petals") lists both.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
import warnings
from typing import Optional


def class_at(path: str):
    """The class at ``"module:Name"`` (the family table names transformers' and petals' classes so)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (None: not installed), from its metadata."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def configs_are_dataclasses() -> bool:
    """Whether transformers' configs are dataclasses (5.x: the RoPE fields in ``rope_parameters``, an ``__init__`` of
    each subclass's own, so that a wrapper of the base config's ``__init__`` never runs for a subclass).
    """
    import dataclasses

    from transformers import PretrainedConfig

    return dataclasses.is_dataclass(PretrainedConfig)


@functools.cache
def computes_llama3_itself() -> bool:
    """Whether this transformers computes the ``llama3`` rotary frequencies from a config's own ``rope_scaling``
    (``rope_parameters`` on 5.x): >= 4.43 (its ``modeling_rope_utils``); the pinned 4.33 does not, and dist_eval's
    block option does it there (:func:`dist_eval.backends.rope.rescale_rope`).
    """
    if importlib.util.find_spec("transformers.modeling_rope_utils") is None:
        return False
    return "llama3" in getattr(importlib.import_module("transformers.modeling_rope_utils"), "ROPE_INIT_FUNCTIONS", {})


def attention_choice(family) -> dict:
    """``from_pretrained``'s keyword for ``family.local_attention`` where this transformers takes one (>= 4.36 has
    ``attn_implementation``; the pinned 4.33 has no choice and no such keyword: {}). ``layers.DIVIDED_ATTENTION`` is
    registered with transformers' attention and mask interfaces (its mask: the eager one) the first time.
    """
    from transformers import PretrainedConfig

    if not hasattr(PretrainedConfig, "_attn_implementation"):
        return {}
    from dist_eval.backends.layers import DIVIDED_ATTENTION, divided_attention

    if family.local_attention == DIVIDED_ATTENTION:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(DIVIDED_ATTENTION, divided_attention)
        AttentionMaskInterface.register(DIVIDED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return {"attn_implementation": family.local_attention}


def loads_through_module_hooks() -> bool:
    """Whether transformers' ``from_pretrained`` hands a model's tensors to its modules' ``_load_from_state_dict``
    (4.x; their load hooks run), not to its own loader that sets them (5.x's ``core_model_loading``).
    """
    return importlib.util.find_spec("transformers.core_model_loading") is None


class _ScopedReplacement:
    """A module's function replaced while any context is inside :meth:`within`, the replacement acting only in the
    contexts (threads) inside: a call from another thread meets the original. Contexts may enter and leave in any
    order, from any thread (loads in a caller's threads): the original is back once the last one has left, never
    another context's replacement left in place (nor put back over another's patch set meanwhile).
    """

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        self._lock = threading.Lock()
        self._inside, self._original, self._dispatch = 0, None, None
        self._chosen = contextvars.ContextVar(f"dist_eval_{name}", default=None)

    def original(self):
        """The module's function as it is outside every context (None where the module has none)."""
        with self._lock:
            return self._original if self._inside else getattr(importlib.import_module(self.module), self.name, None)

    @contextlib.contextmanager
    def within(self, make):
        """Within: the module's function is ``make(original)`` in this context (made on the original, not on an
        outer context's replacement: dist_eval nests none of its own).
        """
        module = importlib.import_module(self.module)
        with self._lock:
            original = self._original if self._inside else getattr(module, self.name)
            replacement = make(original)  # before anything changes: a failure here leaves all as it was
            if not self._inside:
                self._original, self._dispatch = original, self._dispatcher(original)
                setattr(module, self.name, self._dispatch)
            self._inside += 1
        token = self._chosen.set(replacement)
        try:
            yield
        finally:
            try:
                self._chosen.reset(token)
            finally:
                with self._lock:
                    self._inside -= 1
                    # another's replacement set meanwhile (transformers' no_init_weights) is theirs to undo
                    if not self._inside and getattr(module, self.name, None) is self._dispatch:
                        setattr(module, self.name, self._original)

    def _dispatcher(self, original):
        @functools.wraps(original)
        def dispatch(*args, **kwargs):
            return (self._chosen.get() or original)(*args, **kwargs)
        return dispatch


_NORMAL = _ScopedReplacement("torch.nn.init", "normal_")
_QUANTIZER = _ScopedReplacement("transformers.modeling_utils", "get_hf_quantizer")
_LOAD_REPORT = _ScopedReplacement("transformers.modeling_utils", "log_state_dict_report")


@contextlib.contextmanager
def no_random_init_of_meta_tensors():
    """Within: ``torch.nn.init.normal_`` leaves meta tensors alone.

    transformers builds a model's modules on the meta device before it loads their
    weights; ``nn.Embedding`` then calls ``normal_`` on a meta tensor, which makes torch
    import ``torch._dynamo`` (seconds of CPU in every client and server process) to fill a
    tensor that holds no values. Skipping that changes nothing: a meta tensor has no
    data and draws no random numbers. Every other tensor goes to torch's ``normal_``.
    """
    def skipping_meta(original):
        def normal_(tensor, *args, **kwargs):
            return tensor if tensor.is_meta else original(tensor, *args, **kwargs)
        return normal_

    with _NORMAL.within(skipping_meta):
        yield


@contextlib.contextmanager
def no_quantizer_for_remote_blocks():
    """Within: transformers' ``from_pretrained`` sets up no quantizer for config.json's ``quantization_config``.

    For petals' client, whose blocks are remote: the quantized weights a folder's ``quantization_config`` describes
    (FP8 tiles, MXFP4 or INT4 experts) are the blocks', which the servers read and dequantize; the client holds the
    embeddings, the final norm and the heads, saved unquantized. transformers 5.x would still set up the
    method's quantizer for the client's load, and some quantizers need a package of their own the client never uses
    (compressed-tensors' INT4 raised ImportError: ``compressed-tensors>=0.15.0 is required``). The config keeps its
    ``quantization_config``; the pinned transformers (no such quantizers) is left as it is.
    """
    if _QUANTIZER.original() is None:  # the pinned transformers
        yield
        return

    def none_from_config(original):
        def get_hf_quantizer(config, quantization_config, device_map, *args, **kwargs):
            if quantization_config is not None:  # asked by the caller, not read from config.json: as transformers
                return original(config, quantization_config, device_map, *args, **kwargs)
            return None, config, device_map
        return get_hf_quantizer

    with _QUANTIZER.within(none_from_config):
        yield


class _OnlyHeadsNewlyInitialized(logging.Filter):
    """Drops transformers' "... newly initialized: [names]" when every name is a weight of ``heads``, and 4.x's
    "... not used when initializing X: [names]" when every name is one of ``unread``.
    """

    def __init__(self, heads: tuple, unread: tuple = ()):
        super().__init__()
        self.heads, self.unread, self.thread = heads, unread, threading.get_ident()  # the load's own

    def filter(self, record: logging.LogRecord) -> bool:
        import ast
        import re

        # another thread's load (a caller's own) is said as ever; a logger's filters run in the thread that logs
        # (record.thread is None where logging.logThreads is off)
        if threading.get_ident() != self.thread:
            return True
        found = re.search(r"(newly initialized|not used when initializing \w+): (\[[^\]]*\])", record.getMessage())
        if found is None:
            return True
        try:
            names = ast.literal_eval(found.group(2))
        except (ValueError, SyntaxError):
            return True
        if found.group(1) == "newly initialized":
            return not names or not _all_of_heads(names, self.heads)
        return not names or not set(map(str, names)) <= set(self.unread)


@contextlib.contextmanager
def heads_read_after(*heads: str, unread: tuple = ()):
    """Within: transformers' "Some weights of ... were not initialized from the model checkpoint ... and are newly
    initialized: [...]" dropped where every weight it names is of ``heads`` (top-level modules: the classifier's,
    a causal LM's), which the load reads right after (the trained head, a release's LM head saved under another
    name) or refuses where there is none; so are the folder's weights of ``unread`` the model does not read (names: a
    causal LM's head weight beside a classifier, in every causal LM save; transformers 4.x's line where it names no
    other, 5.x's rows of them); and "You are using a
    model of type A to instantiate a model of type B" where A is one of family B's other names (the same blocks,
    read so on purpose: :class:`_AliasTypeNote`). Noise for any caller of ``load_model``, whose logging is left as
    it is (filters on transformers' loggers, for the load alone and in its own thread: a load in another thread,
    a caller's, is told as ever; :class:`_ScopedReplacement`). A block's weight missing or unread, a head's other
    weight unread (a bias the classifier does not have), another pair of types, are said as ever.
    """
    logger, config_logger = logging.getLogger("transformers.modeling_utils"), logging.getLogger(
        "transformers.configuration_utils")
    only_heads, alias = _OnlyHeadsNewlyInitialized(heads, unread), _AliasTypeNote()
    logger.addFilter(only_heads)
    config_logger.addFilter(alias)
    try:
        if _LOAD_REPORT.original() is None:  # before transformers 5.0 (no LOAD REPORT table): the filters alone
            yield
        else:
            with _LOAD_REPORT.within(lambda report: functools.partial(_report_without_heads, report, heads, unread)):
                yield
    finally:
        logger.removeFilter(only_heads)
        config_logger.removeFilter(alias)


def _report_without_heads(report, heads: tuple, unread: tuple, *args, **kwargs):
    """The load report of transformers >= 5.0 (``report``) without its MISSING rows where every missing weight is
    of ``heads``, as the 4.x line is dropped, nor the UNEXPECTED rows of ``unread`` (names); the report's other rows
    (and any error it raises) as they are.
    """
    import dataclasses

    info = kwargs.get("loading_info")
    if info is not None and info.missing_keys and _all_of_heads(info.missing_keys, heads):
        info = kwargs["loading_info"] = dataclasses.replace(info, missing_keys=set())
    if info is not None and info.unexpected_keys:
        said = {key for key in info.unexpected_keys if str(key) not in unread}
        if len(said) != len(info.unexpected_keys):  # the others' rows as they are
            kwargs["loading_info"] = dataclasses.replace(info, unexpected_keys=said)
    return report(*args, **kwargs)


def _all_of_heads(names, heads: tuple) -> bool:
    """Whether every weight name of ``names`` is of a top-level module among ``heads``."""
    return all(str(name).split(".")[0] in heads for name in names)


class _AliasTypeNote(logging.Filter):
    """Drops transformers' "You are using a model of type `A` to instantiate a model of type `B`" where A is one of
    family B's other names (``Family.model_type_aliases``: the same blocks, read so on purpose); any other pair is
    said as ever, and so is another thread's.
    """

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        import re

        from dist_eval.backends.families import family_named

        if threading.get_ident() != self.thread:
            return True
        found = re.match(r"You are using a model of type `([^`]+)` to instantiate a model of type `([^`]+)`",
                         record.getMessage())
        if found is None or found.group(1) == found.group(2):
            return True
        family = family_named(found.group(1))
        return family is None or family.model_type != found.group(2)


def quiet_warnings() -> None:
    """Filter two warnings by their message, and nothing else: what importing petals does
    in any process, a caller's own included (no environment variable, no library's verbosity:
    a user's process is left as it was, but for two lines of noise).
    """
    warnings.filterwarnings("ignore", message=r".*_register_pytree_node.*")
    warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter.*")


def quiet_third_party_output() -> None:
    """Silence warnings that are noise for this tool's users, in every process we own (the
    CLI's ranks, the swarm servers; never a caller of ``evaluate``: it sets variables).

    - transformers 4.33 + torch 2.13: a FutureWarning about ``_register_pytree_node``;
    - petals' server loading blocks onto meta tensors: one UserWarning per weight;
    - "Some weights ... newly initialized: ['score.weight']": we load the trained head
      right after from the checkpoint, and refuse to run when there is none;
    - transformers' progress bar at each load ("Loading weights" on 5.x, checkpoint shards on 4.33);
    - huggingface/tokenizers' "the current process just got forked" (hivemind forks its
      DHT process after a tokenizer was used): it turns the tokenizer's own threads off,
      which it then does anyway; saying so up front keeps the log clean.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_warnings()
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # "Loading weights" (5.x) or checkpoint shards at each load
    except ImportError:
        pass
    # "Generating train split: ..." bars belong to interactive notebooks, not to a job log.
    # Said through the variables datasets reads at import, so that a process that never
    # loads data (a swarm server) does not import datasets for it (CPU time at every start).
    # matplotlib logs "generated new fontManager" at INFO the first time it is imported on a
    # machine, which hivemind's root-logger handler then prints in a run's output.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    datasets = sys.modules.get("datasets")
    if datasets is not None:  # imported already: its variables were read before ours were set
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
