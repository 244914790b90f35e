"""The one place where petals 2.2.0 is made to work with hivemind 1.1.12.

Every process that imports petals (evaluator ranks and swarm servers alike) must go
through :func:`import_petals` instead of ``import petals``.

Why this exists: petals 2.2.0.post1 pins hivemind 1.1.10.post2, which has no wheel and
downloads its p2pd binary at build time (impossible offline or on an air-gapped
cluster). hivemind 1.1.12 ships p2pd in its wheel but no longer re-exports, from its
top-level package, names that petals imports as ``from hivemind import X``. They still
exist in submodules; we put them back on the ``hivemind`` module before petals loads.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import sys
import warnings

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

_patched = False


class PetalsNotInstalledError(ImportError):
    pass


def _patch_hivemind() -> None:
    import hivemind

    for name, module_name in _HIVEMIND_REEXPORTS.items():
        if not hasattr(hivemind, name):
            setattr(hivemind, name, getattr(importlib.import_module(module_name), name))


def make_servicer_stubs_thread_safe() -> None:
    """Make hivemind's lazy stub-class creation safe when several threads make it at once.

    Why: ``ServicerBase.get_stub`` calls ``_collect_rpc_handlers``, which marks the class
    as collected (``_rpc_handlers = []``) *before* it builds ``_stub_type``. A second
    thread that asks for a stub in that window skips the collection and calls
    ``_stub_type`` while it is still None: ``TypeError: 'NoneType' object is not
    callable``. A rank's first forwards (``--in-flight`` threads, each fetching the
    servers' rpc_info) hit exactly that window, so a fresh client's first requests
    failed now and then and were routed around as if a server had failed. One lock
    around the collection closes the window; later calls find it done at once.
    Idempotent.
    """
    import threading

    from hivemind.p2p.servicer import ServicerBase

    if getattr(ServicerBase, "_dist_eval_thread_safe", False):
        return
    collect = ServicerBase._collect_rpc_handlers.__func__
    lock = threading.RLock()

    def _collect_rpc_handlers(cls) -> None:
        with lock:
            collect(cls)

    _collect_rpc_handlers.__wrapped__ = collect  # hivemind's own, for tests
    ServicerBase._collect_rpc_handlers = classmethod(_collect_rpc_handlers)
    ServicerBase._dist_eval_thread_safe = True


def _silence_version_check() -> None:
    # petals' server asks PyPI for a newer version at start; offline it logs a full
    # traceback that looks like a failure. The check is informational only.
    import petals.utils.version as version

    def _no_version_check() -> None:
        pass

    version.validate_version = _no_version_check
    try:
        import petals.cli.run_server as run_server

        run_server.validate_version = _no_version_check
    except ImportError:  # server extras missing: the client still works
        pass


def import_petals():
    """Import and return the ``petals`` module with the hivemind compatibility applied."""
    global _patched
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import hivemind  # noqa: F401
    except ImportError as e:
        raise PetalsNotInstalledError(
            "--backend petals needs hivemind and petals, which are not importable in this "
            f"Python ({e}). Install them with ./launch/install.sh (plain `pip install petals` "
            "cannot work offline: see README 'Install')."
        ) from e
    if not _patched:
        quiet_third_party_output()
        _patch_hivemind()
        make_servicer_stubs_thread_safe()
    try:
        import petals
    except ImportError as e:
        raise PetalsNotInstalledError(
            f"petals is not importable ({e}). Install it with ./launch/install.sh."
        ) from e
    if not _patched:
        _silence_version_check()
        _patched = True
    return petals


@contextlib.contextmanager
def no_random_init_of_meta_tensors():
    """Within: ``torch.nn.init.normal_`` leaves meta tensors alone.

    transformers builds a model's modules on the meta device before it loads their
    weights; ``nn.Embedding`` then calls ``normal_`` on a meta tensor, which makes torch
    import ``torch._dynamo`` (2-4 s of CPU in every client and server process) to fill a
    tensor that holds no values. Skipping that changes nothing: a meta tensor has no
    data and draws no random numbers. Every other tensor goes to torch's ``normal_``.
    """
    import torch

    original = torch.nn.init.normal_

    def normal_(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else original(tensor, *args, **kwargs)

    torch.nn.init.normal_ = normal_
    try:
        yield
    finally:
        torch.nn.init.normal_ = original


def quiet_third_party_output() -> None:
    """Silence warnings that are noise for this tool's users, in every process we own.

    - transformers 4.33 + torch 2.13: a FutureWarning about ``_register_pytree_node``;
    - petals' server loading blocks onto meta tensors: one UserWarning per weight;
    - "Some weights ... newly initialized: ['score.weight']": we load the trained head
      right after from the checkpoint, and refuse to run when there is none;
    - huggingface/tokenizers' "the current process just got forked" (hivemind forks its
      DHT process after a tokenizer was used): it turns the tokenizer's own threads off,
      which it then does anyway; saying so up front keeps the log clean.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=r".*_register_pytree_node.*")
    warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter.*")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    # "Generating train split: ..." bars belong to interactive notebooks, not to a job log.
    # Said through the variables datasets reads at import, so that a process that never
    # loads data (a swarm server) does not import datasets for it (~0.5 s of CPU each).
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    datasets = sys.modules.get("datasets")
    if datasets is not None:  # imported already: its variables were read before ours were set
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


def quiet_hivemind_logs(level: int = logging.WARNING) -> None:
    """Keep hivemind/petals INFO chatter (routes, DHT) out of the evaluator's output."""
    for name in ("hivemind", "petals"):
        logging.getLogger(name).setLevel(level)


def ensure_main_thread_event_loop() -> None:
    """Leave a current event loop set in the main thread.

    The petals client keeps a replica of its P2P handle in this process; at interpreter
    exit its ``__del__`` calls ``asyncio.get_event_loop()``, which under hivemind's
    uvloop policy raises when no loop is set, printing three tracebacks per process.
    """
    try:
        asyncio.get_event_loop()
    except RuntimeError:
        asyncio.set_event_loop(asyncio.new_event_loop())


_SHUTDOWN_WAIT = 2.0  # seconds each step of a client's shutdown may take (~0.1 s when healthy)


def release_waits_on_dead_helpers(manager, error: BaseException) -> None:
    """Make every wait of this process on a dead DHT process or p2pd daemon end with ``error``.

    - calls into the DHT process (``MPFuture``): a routing refresh waits on one with no
      time limit, and would wait forever on a dead process;
    - the routing ``ready`` event that forwards wait for after a failure: set, so they go
      on to their next attempt, which raises ``error`` (see the failover patch);
    - requests waiting for an answer from a dead p2pd (its connection is gone, the
      answer never comes): failed on hivemind's event loop.

    Safe to call repeatedly (a refresh may start a new wait after the last release).
    """
    from hivemind.utils.mpfuture import MPFuture

    if MPFuture._active_pid == os.getpid():
        for ref in list((MPFuture._active_futures or {}).values()):
            future = ref()
            if future is not None and not future.done():
                with contextlib.suppress(Exception):
                    future.set_exception(error)
    manager.ready.set()
    control = getattr(getattr(getattr(manager.state, "p2p", None), "_client", None), "control", None)
    if control is None:
        return
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    def fail_pending_calls() -> None:
        for future in list(control._pending_calls.values()):
            if not future.done():
                future.set_exception(error)

    with contextlib.suppress(Exception):
        RemoteExpertWorker._event_loop_fut.result(timeout=0).call_soon_threadsafe(fail_pending_calls)


def shutdown_petals_client(sequence_manager) -> None:
    """Stop a petals client's DHT and routing thread explicitly, given its sequence manager
    (``<the model's block stack>.sequence_manager``; None: nothing to stop).

    Without this, hivemind's ``__del__`` hooks run at interpreter exit after the event
    loop is gone and print "no current event loop" errors (the exit code stays 0).
    """
    ensure_main_thread_event_loop()
    if sequence_manager is None:
        return
    try:  # bounded: a routing refresh stuck on a dead DHT process never ends
        sequence_manager._thread.shutdown(timeout=_SHUTDOWN_WAIT)
    except Exception:  # best effort: shutting down must never mask a real error
        pass
    # The P2P replica's tasks live on hivemind's worker event loop; close them there now.
    # Left to ``__del__`` at interpreter exit, asyncio is already torn down and each
    # process prints "Exception ignored in: P2P.__del__" tracebacks.
    p2p = getattr(getattr(sequence_manager, "state", None), "p2p", None)
    if p2p is not None:
        try:
            from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

            RemoteExpertWorker.run_coroutine(p2p.shutdown(), return_future=True).result(timeout=_SHUTDOWN_WAIT)
        except Exception:
            pass
    dht = getattr(sequence_manager, "dht", None)
    if dht is not None:
        try:
            dht.shutdown()
        except Exception:
            pass
