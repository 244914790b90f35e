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
import os
import threading
from typing import Callable, Dict, Iterable, List, Tuple

from dist_eval.backends.compat import installed_version, quiet_warnings
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
    3. petals' PyPI version check, off (offline it logs a traceback);
    4. failover: a failed server leaves routing at once; only server failures ban;
    5. a batch goes as one request, split only to what a server accepts;
    6. deep prompts go once per request;
    7. the kernels a server announces kept (the swarm audit compares servers of the same kernels bit for bit);
    8. no traceback from a pipe handoff to a helper process that a cancel killed (the run reports it).
    """
    from dist_eval.backends.petals import audit, failover, helpers, requests

    check_versions()
    with _lock:
        apply("hivemind_reexports", "both", hivemind_reexports)
        apply("stub_lock", "both", thread_safe_stub_collection)
        import petals  # noqa: F401  (after the re-exports: petals imports them from hivemind)

        apply("no_version_check", "both", no_version_check)
        if apply("failover", "client", failover.failover_replacements):
            failover.quiet_retry_logs()
        apply("request_size", "client", requests.split_replacements)
        apply("deep_prompts", "client", requests.prompt_replacements)
        apply("announced_kernels", "client", audit.announced_kernels_replacements)
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


# patch name -> (what it bridges, the versions it was written against, whether the installed stack still needs it)
BRIDGES: Dict[str, Tuple[str, str, Callable[[], bool]]] = {
    "hivemind_reexports": ("names petals imports from hivemind's top level", "petals 2.2.0.post1, hivemind 1.1.12",
                           _reexports_missing),
    "stub_lock": ("a race in hivemind's lazy stub classes", "hivemind 1.1.12", _stub_collection_unlocked),
    "no_version_check": ("petals' PyPI check at start-up (a traceback offline)", "petals 2.2.0.post1",
                         _version_check_online),
}


def still_needed() -> Dict[str, bool]:
    """{bridge: whether the installed stack still needs it} (after :func:`import_petals`): a bridge found unneeded
    is one to remove, with its version pin.
    """
    return {name: probe() for name, (_, _, probe) in BRIDGES.items()}
