"""Every change dist_eval makes to petals and hivemind, applied in one place per side.

- :func:`apply_client_patches`: every process that imports petals and makes or takes a
  petals client (the evaluator's ranks, a caller's petals model object). Reached only
  through :func:`dist_eval.backends.petals.shims.import_petals`, the one way to import petals.
- :func:`dist_eval.swarm.server.apply_server_patches`: the servers dist_eval starts. It
  lives with the server entry point (``dist_eval.swarm`` sits above this package) and
  applies its patches through :func:`apply` here, in the order they require.

Two kinds of change. **Bridges** (:data:`BRIDGES`) let petals 2.2 run at all on the stack installed beside it:
their bodies live here, each with the version it bridges and a probe of whether the installed stack still needs it
(:func:`still_needed`; a test fails when one no longer is, or no longer applies). **Behaviour** patches make petals
do what dist_eval needs (route around a failed server, one request per batch, the wire, the audit's kernels); their
bodies stay beside the code they serve (:mod:`~dist_eval.backends.petals.failover`,
:mod:`~dist_eval.backends.petals.requests`, :mod:`~dist_eval.backends.petals.audit`, :mod:`dist_eval.swarm.wire`,
:mod:`dist_eval.swarm.merged_forward`, :mod:`dist_eval.swarm.server`). Every one returns the attributes it
replaces, and only :func:`apply` sets them, recording each symbol (:func:`replaced`; docs/design.md, "What
dist_eval changes in petals", lists every symbol with the version it assumes and its test, kept equal to what is
replaced by a test).

Three petals code paths are copied into those bodies, and petals' error texts are parsed:
another petals or hivemind than :data:`SUPPORTED` is refused before anything is patched
(:func:`check_versions`), unless :data:`ALLOW_UNSUPPORTED_ENV` is set.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Callable, Dict, Iterable, List, NamedTuple, Tuple

from dist_eval.backends.compat import class_at, installed_version, quiet_warnings
from dist_eval.errors import UsageError, warn

# The versions the patches were written against and tested with (petals' copied code paths
# and error texts, hivemind's stub collection and module layout).
SUPPORTED = {"petals": "2.2.0.post1", "hivemind": "1.1.12"}
ALLOW_UNSUPPORTED_ENV = "DIST_EVAL_ALLOW_UNSUPPORTED_PETALS"

Replacement = Tuple[object, str, object]  # (module or class, attribute, new value)

_lock = threading.RLock()  # ranks apply from threads in flight; one applies, the others find it done
_applied: Dict[str, Tuple[str, List[Tuple[str, object, str, object]]]] = {}  # name -> (side, replaced)
_versions_checked = False
_quieted = False  # petals' import warns, and the patches' imports too: filtered once


class UnsupportedPetalsError(UsageError, ImportError):
    """The installed petals or hivemind is not a version dist_eval's patches were written for
    (a UsageError: the CLI prints it in one line; an ImportError: petals cannot be used).
    """


def check_versions() -> None:
    """Refuse (:class:`UnsupportedPetalsError`, one line) a petals or hivemind other than
    :data:`SUPPORTED`; with ``DIST_EVAL_ALLOW_UNSUPPORTED_PETALS=1``, one warning line instead.
    A package that is not installed is left to the import, which names the install script.
    """
    global _versions_checked
    if _versions_checked:
        return
    installed = {name: installed_version(name) for name in SUPPORTED}
    wrong = {name: version for name, version in installed.items() if version not in (None, SUPPORTED[name])}
    if wrong:
        found = ", ".join(f"{name} {version}" for name, version in wrong.items())
        wanted = ", ".join(f"{name} {SUPPORTED[name]}" for name in wrong)
        text = (f"installed: {found}; dist_eval's petals patches support {wanted} "
                f"(install those with ./launch/install.sh, or set {ALLOW_UNSUPPORTED_ENV}=1 to try anyway)")
        if os.environ.get(ALLOW_UNSUPPORTED_ENV, "") not in ("", "0"):
            warn(f"{text.split(' (')[0]}; trying anyway ({ALLOW_UNSUPPORTED_ENV} is set): results may be wrong.")
        else:
            raise UnsupportedPetalsError(text)
    _versions_checked = True


class PetalsNotInstalledError(ImportError):
    """hivemind or petals cannot be imported in this Python."""


def import_petals():
    """Import and return the ``petals`` module, every client patch applied (the one way to
    import petals, and the one entry to :func:`~dist_eval.backends.petals.shims.apply_client_patches`).
    An :class:`~dist_eval.backends.petals.shims.UnsupportedPetalsError` for other petals/hivemind versions.
    """
    check_versions()  # before anything is imported or patched
    with environ_as_found():  # petals' import sets BITSANDBYTES_NOWELCOME: not in a caller's process
        return _import_petals()


def _import_petals():
    try:
        import hivemind  # noqa: F401
    except ImportError as e:
        raise PetalsNotInstalledError(
            "--backend petals needs hivemind and petals, which are not importable in this "
            f"Python ({e}). Install them with ./launch/install.sh (plain `pip install petals` "
            "cannot work offline: see README 'Install')."
        ) from e
    global _quieted
    if not _quieted:  # once: petals' import warns, and the patches' imports too
        quiet_warnings()  # no variable set: this may be a caller's own process (evaluate on its model)
        _quieted = True
    try:
        apply_client_patches()
        import petals
    except ImportError as e:
        raise PetalsNotInstalledError(
            f"petals is not importable ({e}). Install it with ./launch/install.sh."
        ) from e
    return petals


@contextlib.contextmanager
def environ_as_found():
    """Within: anything; after: ``os.environ`` as it was before (variables set are removed,
    changed or removed ones put back), so that no import leaves one in a caller's process.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def symbol(owner, attribute: str) -> str:
    """``module.attribute`` or ``module.Class.attribute``: how :func:`replaced` names a patched symbol."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{attribute}"
    return f"{owner.__name__}.{attribute}"


def apply(name: str, side: str, build: Callable[[], Iterable[Replacement]], after: Tuple[str, ...] = ()) -> bool:
    """Apply the patch ``name`` once per process: set what ``build()`` returns and record it.
    ``after``: the patches that must be in place first (one wraps what the other set);
    a RuntimeError if one is not. True if it was applied now, False if it already was.
    """
    with _lock:
        if name in _applied:
            return False
        missing = [earlier for earlier in after if earlier not in _applied]
        if missing:
            raise RuntimeError(f"patch {name!r} applied before {missing}: it wraps what they set, so they go first "
                               "(apply the server patches through dist_eval.swarm.server.apply_server_patches)")
        done = []
        for owner, attribute, value in build():
            done.append((symbol(owner, attribute), owner, attribute, owner.__dict__.get(attribute)))
            setattr(owner, attribute, value)
        _applied[name] = (side, done)
        return True


def replaced() -> Dict[str, str]:
    """{patched symbol: "client", "server" or "both"} of every patch applied in this process."""
    return {sym: side for side, done in _applied.values() for sym, *_ in done}


def applied() -> List[str]:
    """The names of the patches applied in this process, in the order they were applied."""
    return list(_applied)


def apply_client_patches() -> None:
    """Apply every client patch (and the two every petals process needs), in their order. Idempotent.

    1. hivemind's top-level re-exports that petals imports (before petals is imported);
    2. the lock around hivemind's stub-class collection (threads in flight ask at once);
    3. on transformers 5.x, petals' import made possible (:data:`BRIDGES`: its version assert, a helper 5.x
       removed, peft 0.5's names when petals' adapters module is imported);
    4. petals' PyPI version check, off (offline it logs a traceback); on 5.x, petals' client built on the CPU, its
       tied LM head a parameter before 5.x ties it, and a folder's petals classes chosen by its model_type as saved;
    5. failover: a failed server leaves routing at once; only server failures ban; every route leaves out the
       servers that announce other RoPE settings than the client's config.json;
    6. a batch goes as one request, split only to what a server accepts;
    7. deep prompts go once per request;
    8. the kernels a server announces kept (the swarm audit compares servers of the same kernels bit for bit);
    9. no traceback from a pipe handoff to a helper process that a cancel killed (the run reports it).
    """
    from dist_eval.backends.petals import audit, failover, helpers, requests

    check_versions()
    with _lock:
        apply("hivemind_reexports", "both", hivemind_reexports)
        apply("stub_lock", "both", thread_safe_stub_collection)
        bridge("petals_version_assert", "both", ignore_petals_version_assert)
        bridge("get_file_from_repo", "both", get_file_from_repo_back)
        peft_names_on_import()
        import petals  # noqa: F401  (after the re-exports: petals imports them from hivemind)

        apply("no_version_check", "both", no_version_check)
        bridge("model_type_as_saved", "both", model_type_as_saved)
        bridge("client_dht_on_cpu", "client", client_dht_on_cpu)
        bridge("prefix_tokens_on_cpu", "client", prefix_tokens_on_cpu)
        bridge("tied_lm_head_on_meta", "client", tied_lm_head_on_meta)
        if apply("failover", "client", failover.failover_replacements):
            failover.quiet_retry_logs()
        apply("request_size", "client", requests.split_replacements)
        apply("deep_prompts", "client", requests.prompt_replacements)
        apply("announced_numerics", "client", audit.announced_numerics_replacements)
        apply("quiet_lost_handoffs", "client", helpers.quiet_lost_handoffs)


def own_hivemind_locks() -> None:
    """Give this process hivemind's process-wide locks of its own; call it in a child right after a fork.

    Why: hivemind makes multiprocessing locks when it is imported (``SharedBytes._lock``, taken each time
    an ``MPFuture`` is made, so by every task a server runs; ``MPFuture``'s ``_initialization_lock`` and
    ``_update_lock``; ``_AsyncContextWrapper.EXECUTOR_LOCK``). They are semaphores in shared memory, shared
    by every process forked from the one that imported hivemind. The servers of a local swarm are forked from
    one fork server (:mod:`dist_eval.swarm.forks`), so they shared them: a server SIGKILLed while it held
    one left it taken for good, and every other server hung at its next request (the healthy servers of
    tests/test_swarm_failover.py answered nothing for 60 s, in about one run in eight). The processes of one
    server (its handlers, runtime and DHT, forked later) still share the server's own, as hivemind means.
    A no-op where hivemind is not imported.
    """
    import multiprocessing
    import sys

    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # hivemind's own: new _initialization_lock, _update_lock, SharedBytes._lock
    asyncio_utils = sys.modules.get("hivemind.utils.asyncio")
    if asyncio_utils is not None:
        asyncio_utils._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


# ---------------------------------------------------------------- hivemind and petals' start-up

# petals 2.2.0.post1 pins hivemind 1.1.10.post2, which has no wheel and downloads its p2pd
# binary at build time (impossible offline or on an air-gapped cluster). hivemind 1.1.12
# ships p2pd in its wheel but no longer re-exports, from its top-level package, names that
# petals imports as ``from hivemind import X``. They still exist in submodules; they are put
# back on the ``hivemind`` module before petals loads.
# name -> submodule of hivemind 1.1.12 that still defines it
_HIVEMIND_REEXPORTS = {
    "BatchTensorDescriptor": "hivemind.utils.tensor_descr",
    "TensorDescriptor": "hivemind.utils.tensor_descr",
    "MAX_DHT_TIME_DISCREPANCY_SECONDS": "hivemind.utils",
    "MSGPackSerializer": "hivemind.utils",
    "TimedStorage": "hivemind.utils",
    "get_dht_time": "hivemind.utils",
    "get_logger": "hivemind.utils",
    "nested_compare": "hivemind.utils.nested",
    "nested_flatten": "hivemind.utils.nested",
    "nested_pack": "hivemind.utils.nested",
    "anext": "hivemind.utils.asyncio",
    "P2P": "hivemind.p2p",
    "P2PContext": "hivemind.p2p",
    "PeerID": "hivemind.p2p",
    "serialize_torch_tensor": "hivemind.compression",
    "deserialize_torch_tensor": "hivemind.compression",
    "deserialize_tensor_stream": "hivemind.compression",
    "Runtime": "hivemind.moe.server.runtime",
}


def hivemind_reexports() -> List[Replacement]:
    """The names petals imports from ``hivemind`` that hivemind 1.1.12 lacks there, from its submodules."""
    import importlib

    import hivemind

    return [(hivemind, name, getattr(importlib.import_module(module_name), name))
            for name, module_name in _HIVEMIND_REEXPORTS.items() if not hasattr(hivemind, name)]


def thread_safe_stub_collection() -> List[Replacement]:
    """The lazy stub-class creation of hivemind, made safe when several threads make it at once.

    Why: ``ServicerBase.get_stub`` calls ``_collect_rpc_handlers``, which marks the class
    as collected (``_rpc_handlers = []``) *before* it builds ``_stub_type``. A second
    thread that asks for a stub in that window skips the collection and calls
    ``_stub_type`` while it is still None: ``TypeError: 'NoneType' object is not
    callable``. A rank's first forwards (``--in-flight`` threads, each fetching the
    servers' rpc_info) hit exactly that window, so a fresh client's first requests
    failed now and then and were routed around as if a server had failed. One lock
    around the collection closes the window; later calls find it done at once.
    """
    from hivemind.p2p.servicer import ServicerBase

    collect = ServicerBase._collect_rpc_handlers.__func__
    lock = threading.RLock()

    def _collect_rpc_handlers(cls) -> None:
        with lock:
            collect(cls)

    _collect_rpc_handlers.__wrapped__ = collect  # hivemind's own, for tests
    return [(ServicerBase, "_collect_rpc_handlers", classmethod(_collect_rpc_handlers))]


def no_version_check() -> List[Replacement]:
    """No check of PyPI for a newer petals: a server makes it at start and, offline,
    logs a full traceback that looks like a failure. The check is informational only.
    """
    import petals.utils.version as version

    def _no_version_check() -> None:
        pass

    replacements = [(version, "validate_version", _no_version_check)]
    try:
        import petals.cli.run_server as run_server

        replacements.append((run_server, "validate_version", _no_version_check))
    except ImportError:  # server extras missing: the client still works
        pass
    return replacements


# ---------------------------------------------------------------- transformers 5.x: petals' import and client

# petals 2.2.0.post1 was written for transformers 4.32-4.34, peft 0.5.0 and huggingface-hub < 1.0. On transformers
# 5.x (and a current peft) the bridges below let its client and server run, nothing installed edited; each applies
# only where its versions (BRIDGES) are installed, a no-op on the pinned stack.


def ignore_petals_version_assert() -> List[Replacement]:
    """Petals' ``__init__`` asserts 4.32 <= transformers < 4.35 unless ``PETALS_IGNORE_DEPENDENCY_VERSION`` is set,
    its own escape: set for its import (:func:`import_petals` removes it again after; nothing is replaced).
    """
    os.environ["PETALS_IGNORE_DEPENDENCY_VERSION"] = "1"
    return []


def get_file_from_repo_back() -> List[Replacement]:
    """``transformers.utils.get_file_from_repo`` (gone in 5.x; petals' server loader and adapters module import
    it), as 4.33 had it, on ``cached_file``: the file's path, or None where the file does not exist.
    """
    import transformers.utils
    from transformers.utils.hub import cached_file

    def get_file_from_repo(path_or_repo, filename, cache_dir=None, force_download=False, resume_download=False,
                           proxies=None, token=None, revision=None, local_files_only=False, subfolder="",
                           use_auth_token=None, **kwargs):
        return cached_file(path_or_repo_id=path_or_repo, filename=filename, cache_dir=cache_dir,
                           force_download=force_download, proxies=proxies, token=token or use_auth_token,
                           revision=revision, local_files_only=local_files_only, subfolder=subfolder,
                           _raise_exceptions_for_gated_repo=False, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)

    return [(transformers.utils, "get_file_from_repo", get_file_from_repo)]


def model_type_as_saved() -> List[Replacement]:
    """Petals' ``AutoDistributed*.from_pretrained`` of a folder picks its class by config.json's ``model_type`` as
    saved, as the pinned stack did: petals reads it through transformers' AutoConfig, which, where transformers has a
    model of that name (5.x: Kimi K2.5's, the vision-language wrapper), builds that model's config from a folder of
    the family dist_eval builds (the text model's fields) and refuses it. A hub id, and a type petals does not
    serve, go to petals' own.
    """
    from petals.utils import auto_config

    from dist_eval.backends.config_json import saved_family_type

    original = auto_config._AutoDistributedBase.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, model_name_or_path, *args, **kwargs):
        classes = auto_config._CLASS_MAPPING.get(saved_family_type(model_name_or_path))
        proper = getattr(classes, cls._mapping_field, None) if classes is not None else None
        if proper is None:
            return original(cls, model_name_or_path, *args, **kwargs)
        return proper.from_pretrained(model_name_or_path, *args, **kwargs)

    return [(auto_config._AutoDistributedBase, "from_pretrained", classmethod(from_pretrained))]


# peft 0.5.0's list, which petals' adapters module imports from peft.utils
_PEFT_LAYERS_PATTERN = ["layers", "h", "block", "blocks", "layer"]


def peft_names() -> List[Replacement]:
    """The names of peft 0.5.0 that ``petals.utils.peft`` imports and a current peft lacks: ``peft.utils``'s
    ``COMMON_LAYERS_PATTERN``, ``peft.tuners.lora``'s ``Linear8bitLt`` and ``Linear4bit`` (now in
    ``peft.tuners.lora.bnb``). For its import only: a current peft's LoRA layers are built otherwise than 0.5's,
    so a server started with ``--adapters`` still fails in petals' ``create_lora_adapter``.
    """
    import peft.tuners.lora as lora
    import peft.utils

    try:
        import peft.tuners.lora.bnb as bnb
    except Exception:  # bitsandbytes unusable here: names only
        bnb = None
    replacements = [(peft.utils, "COMMON_LAYERS_PATTERN", list(_PEFT_LAYERS_PATTERN))]
    for name in ("Linear8bitLt", "Linear4bit"):
        if not hasattr(lora, name):
            replacements.append((lora, name, getattr(bnb, name, None) or type(name, (lora.Linear,), {})))
    return replacements


class _BeforePetalsPeft:
    """A meta-path finder: the peft bridge applied as ``petals.utils.peft`` is first imported (peft's import costs
    a server without adapters bitsandbytes', which ``swarm.server._peft_on_demand`` spares it).
    """

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "petals.utils.peft" and "peft_names" not in _applied:
            bridge("peft_names", "both", peft_names)
        return None


def peft_names_on_import() -> None:
    """:class:`_BeforePetalsPeft` on ``sys.meta_path`` (once)."""
    import sys

    if _BeforePetalsPeft not in sys.meta_path and "petals.utils.peft" not in sys.modules:
        sys.meta_path.insert(0, _BeforePetalsPeft)


def _on_cpu(original):
    """``original`` run under ``torch.device("cpu")``."""
    import functools

    @functools.wraps(original)
    def on_cpu(*args, **kwargs):
        import torch

        with torch.device("cpu"):
            return original(*args, **kwargs)

    return on_cpu


def client_dht_on_cpu() -> List[Replacement]:
    """Petals' ``RemoteSequential.__init__`` on the CPU: 5.x's ``from_pretrained`` builds the model under
    ``torch.device("meta")``, and the client's DHT that it starts makes its shared buffer with ``torch.empty``
    (``_share_filename_: only available on CPU``). It holds no parameters.
    """
    from petals.client.remote_sequential import RemoteSequential

    return [(RemoteSequential, "__init__", _on_cpu(RemoteSequential.__init__))]


def prefix_tokens_on_cpu() -> List[Replacement]:
    """Petals' ``PTuneMixin.init_prompts`` keeps ``prefix_tokens`` as a plain attribute, which 5.x's meta init
    context leaves on meta (the loader materializes parameters and buffers only): remade on the CPU.
    """
    import functools

    from petals.client.ptune import PTuneMixin

    original = PTuneMixin.init_prompts

    @functools.wraps(original)
    def init_prompts(self, config):
        import torch

        original(self, config)
        prefix = getattr(self, "prefix_tokens", None)
        if prefix is not None and prefix.is_meta:
            self.prefix_tokens = torch.arange(self.pre_seq_len, device="cpu").long()

    return [(PTuneMixin, "init_prompts", init_prompts)]


def tied_lm_head_on_meta() -> List[Replacement]:
    """Petals' ``LMHead`` of a model whose head is tied to its embeddings holds ``weight = None`` until transformers
    ties it; 5.x's ``from_pretrained`` asks each tied key for its parameter before it ties (``lm_head.weight``:
    "is not an nn.Parameter"), and ties only keys the model's state dict has. A placeholder on the meta device
    (no memory), which 5.x's tying replaces with the embeddings' own parameter, as 4.33's did the ``None``.
    """
    from petals.client.lm_head import LMHead

    original = LMHead.__init__

    @functools.wraps(original)
    def __init__(self, config):
        import torch

        original(self, config)
        if self.weight is None:
            meta = torch.empty(config.vocab_size, config.hidden_size, device="meta")
            self.weight = torch.nn.Parameter(meta, requires_grad=False)

    return [(LMHead, "__init__", __init__)]


# ---------------------------------------------------------------- transformers 5.x: petals' server blocks

# the kinds of Family.server_bridges: kind -> the function of (the class at its path, the kind's other class) that
# returns the kind's replacements. The families (backends.families) name the classes; the bodies are here.


def apply_server_bridges() -> None:
    """Every server bridge (:data:`SERVER_BRIDGES`) of the families' servers (``Family.server_bridges``), in
    :func:`dist_eval.swarm.server.apply_server_patches`, after :func:`import_petals`. Idempotent.
    """
    for kind in SERVER_BRIDGES:
        bridge(kind, "server", lambda kind=kind: [replacement for owner, other in _server_bridge_classes(kind)
                                                  for replacement in SERVER_BRIDGES[kind](owner, other)])


def _server_bridge_classes(kind: str) -> List[Tuple[object, object]]:
    """[(the class a family's ``kind`` bridge replaces on, the kind's other class or None), ...], each once."""
    from dist_eval.backends.families import FAMILIES

    paths = sorted({tuple(entry[1:]) for family in FAMILIES.values() for entry in family.server_bridges
                    if entry[0] == kind})
    return [(class_at(path[0]), class_at(path[1]) if len(path) > 1 else None) for path in paths]


def _causal_mask(input_shape, dtype, device, past_length: int = 0):
    """Transformers 4.33's ``_make_causal_mask``: [bsz, 1, tgt, tgt + past], finfo.min above the diagonal."""
    import torch

    bsz, tgt_len = input_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(cond < (cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_length)


def _expanded_mask(mask, dtype, tgt_len=None):
    """Transformers 4.33's ``_expand_mask``: [bsz, src] (1: attend) -> additive [bsz, 1, tgt, src]."""
    import torch

    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    inverted = 1.0 - mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)


def prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
    """Transformers 4.33's ``_prepare_decoder_attention_mask`` (petals' block calls it with ``self=None``)."""
    combined = None
    if input_shape[-1] > 1:
        combined = _causal_mask(input_shape, inputs_embeds.dtype, inputs_embeds.device, past_key_values_length)
    if attention_mask is not None:
        expanded = _expanded_mask(attention_mask, inputs_embeds.dtype, input_shape[-1]).to(inputs_embeds.device)
        combined = expanded if combined is None else expanded + combined
    return combined


def decoder_mask(model_cls, _other) -> List[Replacement]:
    """The model class's 4.33 ``_prepare_decoder_attention_mask`` (4.35 moved it away, 4.36 removed it)."""
    return [(model_cls, "_prepare_decoder_attention_mask", prepare_decoder_attention_mask)]


def prepare_bool_attn_mask(attention_mask, input_shape, past_key_values_length: int):
    """Transformers 4.33's static ``_prepare_attn_mask`` (bool, True: masked; causal | padding), which petals'
    block calls and its own attention reads.
    """
    import torch

    if input_shape[1] + past_key_values_length != attention_mask.shape[1]:
        raise ValueError(f"Attention mask shape should be (batch_size, seq_length + past_key_values_length) but is "
                         f"{attention_mask.shape} with input_ids shape {input_shape} and past length "
                         f"{past_key_values_length}.")
    device = attention_mask.device
    batch_size, seq_length = input_shape
    total = attention_mask.shape[1]
    expanded = ~(attention_mask[:, None, None, :].to(torch.bool))
    expanded = expanded.expand(batch_size, 1, total - past_key_values_length, total)
    if seq_length <= 1:
        return expanded
    causal = torch.triu(torch.ones((seq_length, seq_length), dtype=torch.bool, device=device), diagonal=1)
    causal = torch.cat([torch.zeros((seq_length, past_key_values_length), dtype=torch.bool, device=device), causal], -1)
    return expanded | causal[None, None].expand(batch_size, 1, seq_length, total)


def bool_mask(model_cls, _other) -> List[Replacement]:
    """The model class's 4.33 static ``_prepare_attn_mask`` (5.x has none)."""
    return [(model_cls, "_prepare_attn_mask", staticmethod(prepare_bool_attn_mask))]


class RotaryAdapter:
    """4.33's per-attention ``rotary_emb(value, seq_len=n)`` -> (cos, sin) [1, 1, n, dim] in the value's dtype, by
    5.x's model-level rotary class of the config (rope_parameters, its scalings, attention_scaling) at positions
    0..n-1, as the 5.x model computes it. Not a module: nothing of it enters the block's state dict or goes to meta.
    """

    def __init__(self, config, rotary_class):
        self.config, self.rotary_class, self.module = config, rotary_class, None

    def __call__(self, value, seq_len=None):
        import torch

        if self.module is None:
            with torch.device("cpu"):
                self.module = self.rotary_class(config=self.config)
        if self.module.inv_freq.device != value.device:
            self.module = self.module.to(value.device)
        cos, sin = self.module(value, torch.arange(seq_len, device=value.device)[None])  # [1, n, dim]
        return cos[:, None], sin[:, None]


def _server_block_index() -> int:
    """The index of the block a server builds (0 where it is not told, as for petals' own blocks)."""
    from dist_eval.backends.layers import SERVER_BLOCK_INDEX

    index = SERVER_BLOCK_INDEX.get()
    return 0 if index is None else int(index)


def attention_init(attention_cls, rotary_class) -> List[Replacement]:
    """Petals' server attention built on 5.x's attention ``(config, layer_idx)``: the block's index passed, then
    4.33's attributes that petals' forward reads (``num_heads``, ``num_key_value_heads``, ``hidden_size``,
    ``max_position_embeddings``, a per-attention ``rotary_emb``: :class:`RotaryAdapter`).
    """
    base = attention_cls.__mro__[1]

    def __init__(self, config, layer_idx=None, **kwargs):
        base.__init__(self, config, _server_block_index() if layer_idx is None else layer_idx)
        self._rotary_graph = None
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.max_position_embeddings = config.max_position_embeddings
        if not hasattr(self, "rotary_emb"):
            self.rotary_emb = RotaryAdapter(config, rotary_class)

    return [(attention_cls, "__init__", __init__)]


def alibi_additive_mask(attention_mask, input_shape, past_length: int, dtype):
    """4.33's bool ``_prepare_attn_mask`` (causal | padding: :func:`prepare_bool_attn_mask`) as the additive mask
    5.x's alibi attention adds to its scores (0 or finfo(dtype).min; 4.33 filled the scores with that same min).
    """
    import torch

    masked = prepare_bool_attn_mask(attention_mask, input_shape, past_length)
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill(masked, torch.finfo(dtype).min)


class TupleCache:
    """What 5.x's alibi attention calls ``layer_past.update(key, value, layer_idx)`` on, over petals' tuple cache in
    4.33's layout (key [batch*heads, head_dim, past], value [batch*heads, past, head_dim]); :meth:`present` gives
    the new (key, value) back in that layout, as 4.33's attention returned it.
    """

    def __init__(self, past, batch_size: int, num_heads: int):
        self.past, self.batch_size, self.num_heads, self.kv = past, batch_size, num_heads, None

    def update(self, key, value, layer_idx=None, *args, **kwargs):
        import torch

        if self.past is not None:
            past_key, past_value = self.past
            head_dim = past_value.shape[-1]
            past_key = past_key.permute(0, 2, 1).reshape(self.batch_size, self.num_heads, -1, head_dim)
            past_value = past_value.reshape(self.batch_size, self.num_heads, -1, head_dim)
            key = torch.cat([past_key.to(key.dtype), key], dim=2)
            value = torch.cat([past_value.to(value.dtype), value], dim=2)
        self.kv = (key, value)
        return key, value

    def get_seq_length(self, layer_idx=0) -> int:
        return 0 if self.past is None else self.past[0].shape[-1]

    def present(self):
        key, value = self.kv
        batch, heads, length, head_dim = key.shape
        return (key.reshape(batch * heads, length, head_dim).permute(0, 2, 1),
                value.reshape(batch * heads, length, head_dim))


def cache_block(block_cls, _other) -> List[Replacement]:
    """Petals' alibi block's forward on 5.x's block: the mask additive (4.33's bool helper is gone; 5.x adds it to
    the scores), petals' tuple ``layer_past`` behind a cache object (:class:`TupleCache`), and 4.33's return
    value: ``(hidden,)``, or ``(hidden, present)`` with ``use_cache`` (5.x returns the attention weights second).
    """
    import sys

    base = block_cls.__mro__[1]
    build_alibi_tensor = sys.modules[base.__module__].build_alibi_tensor

    def forward(self, hidden_states, *args, attention_mask=None, alibi=None, layer_past=None, use_cache=False,
                **kwargs):
        import torch

        assert attention_mask is None, "Non-causal attention masks are not supported yet"
        batch_size, seq_length = hidden_states.shape[:2]
        past_length = 0 if layer_past is None else layer_past[0].shape[-1]
        mask = torch.ones((batch_size, seq_length + past_length), device=hidden_states.device)
        if alibi is None:
            alibi = build_alibi_tensor(mask, num_heads=self.num_heads, dtype=hidden_states.dtype)
        additive = alibi_additive_mask(mask, (batch_size, seq_length), past_length, hidden_states.dtype)
        cache = TupleCache(layer_past, batch_size, self.num_heads) if use_cache or layer_past is not None else None
        kwargs.pop("output_attentions", None)
        output = base.forward(self, hidden_states, alibi, additive, layer_past=cache, use_cache=use_cache,
                              output_attentions=False, **kwargs)[0]
        return (output, cache.present()) if use_cache else (output,)

    return [(block_cls, "forward", forward)]


SERVER_BRIDGES: Dict[str, Callable[[object, object], List[Replacement]]] = {
    "decoder_mask": decoder_mask, "bool_mask": bool_mask, "attention_init": attention_init, "cache_block": cache_block,
}


# ---------------------------------------------------------------- the bridges, and whether each is still needed



def _as_installed(owner, attribute: str):
    """``owner.attribute`` as the installed package has it: the original :func:`apply` recorded where a patch
    replaced it, else the attribute itself (None: absent).
    """
    sym = symbol(owner, attribute)
    for _, done in _applied.values():
        for replaced_symbol, _, _, original in done:
            if replaced_symbol == sym:
                return original
    return owner.__dict__.get(attribute)


def _reexports_missing() -> bool:
    """Whether hivemind's top level, as installed, lacks a name petals imports from it."""
    import hivemind

    return any(_as_installed(hivemind, name) is None for name in _HIVEMIND_REEXPORTS)


def _stub_collection_unlocked() -> bool:
    """Whether hivemind's stub collection marks a class collected before it builds its stub type (the race)."""
    import inspect

    from hivemind.p2p.servicer import ServicerBase

    collect = ServicerBase._collect_rpc_handlers.__func__
    source = inspect.getsource(getattr(collect, "__wrapped__", collect))
    return "threading" not in source and source.find("_rpc_handlers = []") < source.find("_stub_type = ")


def _version_check_online() -> bool:
    """Whether petals' start-up still asks PyPI for its newest version."""
    import inspect

    import petals.utils.version as version

    return "pypi" in inspect.getsource(_as_installed(version, "validate_version")).lower()



def _petals_range_excludes_transformers() -> bool:
    """Whether the installed transformers is outside the range petals 2.2's ``__init__`` asserts."""
    from packaging.version import Version

    found = Version(installed_version("transformers") or "0")
    return not Version("4.32.0") <= found < Version("4.35.0")


def _get_file_from_repo_gone() -> bool:
    """Whether the installed transformers lacks ``transformers.utils.get_file_from_repo``."""
    import transformers.utils

    return _as_installed(transformers.utils, "get_file_from_repo") is None


def _peft_lacks_names() -> bool:
    """Whether the installed peft lacks a name of peft 0.5.0 that petals' adapters module imports (imports peft)."""
    import peft.tuners.lora as lora
    import peft.utils

    return any(_as_installed(owner, name) is None for owner, name in (
        (peft.utils, "COMMON_LAYERS_PATTERN"), (lora, "Linear8bitLt"), (lora, "Linear4bit")))


def _a_built_family_is_native() -> bool:
    """Whether the installed transformers has a model of its own under the type of a family dist_eval builds around
    a text model (``Family.text_prefix``: Kimi K2.5), whose config is not the text model's.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dist_eval.backends.families import FAMILIES

    return any(family.text_prefix and family.model_type in CONFIG_MAPPING
               and CONFIG_MAPPING[family.model_type].__module__.startswith("transformers.")  # not the one built here
               for family in FAMILIES.values())


def _models_built_on_meta() -> bool:
    """Whether transformers' ``from_pretrained`` builds a model under ``torch.device("meta")`` (5.x's
    ``get_init_context``; 4.33 built on the CPU under accelerate's ``init_empty_weights``).
    """
    import inspect

    from transformers import PreTrainedModel

    init_context = getattr(PreTrainedModel, "get_init_context", None)
    return init_context is not None and 'torch.device("meta")' in inspect.getsource(init_context)


def _tied_weights_marked_before_tying() -> bool:
    """Whether transformers' ``from_pretrained`` asks every tied key for its parameter before tying (5.x's
    ``mark_tied_weights_as_initialized``; 4.33 tied petals' ``None`` head as it was).
    """
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "mark_tied_weights_as_initialized")


def _server_bridge_needed(kind: str) -> Callable[[], bool]:
    """The probe of a server bridge: whether some family's classes still lack what ``kind`` gives them."""

    def attention_lacks_layer_index(attention_cls, _other) -> bool:
        import inspect

        return "layer_idx" in inspect.signature(attention_cls.__mro__[1].__init__).parameters

    def block_takes_a_cache(block_cls, _other) -> bool:
        import inspect

        annotation = inspect.signature(block_cls.__mro__[1].forward).parameters["layer_past"].annotation
        return "Cache" in str(annotation)

    missing = {"decoder_mask": lambda cls, _: _as_installed(cls, "_prepare_decoder_attention_mask") is None,
               "bool_mask": lambda cls, _: _as_installed(cls, "_prepare_attn_mask") is None,
               "attention_init": attention_lacks_layer_index, "cache_block": block_takes_a_cache}[kind]
    return lambda: any(missing(owner, other) for owner, other in _server_bridge_classes(kind))


class Bridge(NamedTuple):
    """What a bridge bridges, the installed versions it applies to (requirements, comma-separated: elsewhere it is
    not applied), and its probe: whether the installed stack still needs it.
    """

    what: str
    versions: str
    probe: Callable[[], bool]


_FIVE = "petals==2.2.0.post1, transformers>=5"
BRIDGES: Dict[str, Bridge] = {
    "hivemind_reexports": Bridge("names petals imports from hivemind's top level",
                                 "petals==2.2.0.post1, hivemind==1.1.12", _reexports_missing),
    "stub_lock": Bridge("a race in hivemind's lazy stub classes", "hivemind==1.1.12", _stub_collection_unlocked),
    "no_version_check": Bridge("petals' PyPI check at start-up (a traceback offline)", "petals==2.2.0.post1",
                               _version_check_online),
    "petals_version_assert": Bridge("petals' assert of transformers < 4.35", _FIVE,
                                    _petals_range_excludes_transformers),
    "get_file_from_repo": Bridge("a transformers helper petals imports, gone in 5.x", _FIVE, _get_file_from_repo_gone),
    "peft_names": Bridge("peft 0.5.0's names petals' adapters module imports", "petals==2.2.0.post1, peft>=0.6",
                         _peft_lacks_names),
    "model_type_as_saved": Bridge("petals' class of a folder chosen by transformers' own model of its type", _FIVE,
                                  _a_built_family_is_native),
    "client_dht_on_cpu": Bridge("petals' client built under 5.x's meta device", _FIVE, _models_built_on_meta),
    "prefix_tokens_on_cpu": Bridge("petals' prompt positions made on 5.x's meta device", _FIVE, _models_built_on_meta),
    "tied_lm_head_on_meta": Bridge("petals' tied LM head, a parameter before 5.x ties it", _FIVE,
                                   _tied_weights_marked_before_tying),
    "decoder_mask": Bridge("4.33's decoder mask helper, which petals' server blocks call", _FIVE,
                           _server_bridge_needed("decoder_mask")),
    "bool_mask": Bridge("4.33's bool mask helper, which petals' server blocks call", _FIVE,
                        _server_bridge_needed("bool_mask")),
    "attention_init": Bridge("petals' server attention on 5.x's (layer index, 4.33's attributes, per-attention RoPE)",
                             _FIVE, _server_bridge_needed("attention_init")),
    "cache_block": Bridge("petals' alibi block on 5.x's (additive mask, a cache object, 4.33's outputs)", _FIVE,
                          _server_bridge_needed("cache_block")),
}


def bridged_here(name: str) -> bool:
    """Whether the installed packages satisfy the versions ``BRIDGES[name]`` bridges (else it is not applied)."""
    return satisfied(BRIDGES[name].versions)


def satisfied(versions: str) -> bool:
    """Whether the installed packages satisfy ``versions`` (requirements, comma-separated: ``"peft>=0.6, ..."``)."""
    from packaging.requirements import Requirement

    for text in versions.split(","):
        requirement = Requirement(text.strip())
        found = installed_version(requirement.name)
        if found is None or not requirement.specifier.contains(found, prereleases=True):
            return False
    return True


def bridge(name: str, side: str, build: Callable[[], Iterable[Replacement]]) -> bool:
    """:func:`apply` the bridge ``name``: its replacements where :func:`bridged_here`, none elsewhere (recorded
    as applied either way, so that each entry point applies the same patches on any stack).
    """
    return apply(name, side, lambda: build() if bridged_here(name) else [])


def still_needed() -> Dict[str, bool]:
    """{bridge: whether the installed stack still needs it} (after :func:`import_petals`, and the server's after
    :func:`apply_server_bridges`; the peft bridge's probe imports peft): one found unneeded where
    :func:`bridged_here` is to be removed, or its versions narrowed.
    """
    return {name: bridge.probe() for name, bridge in BRIDGES.items()}
