"""How a process imports petals, and keeps petals' and hivemind's side effects in bounds.

Every process that imports petals (evaluator ranks and swarm servers alike) goes through
:func:`import_petals` instead of ``import petals``: it checks the installed versions and
applies dist_eval's client patches (:mod:`dist_eval.backends.patches`, which also says
why petals 2.2.0 needs hivemind's re-exports put back to import with hivemind 1.1.12).
The rest: quieting third-party output, a bounded client shutdown, no random init of meta
tensors.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import warnings

from dist_eval.backends.patches import apply_client_patches, check_versions

_quieted = False


@functools.cache
def configs_are_dataclasses() -> bool:
    """Whether transformers' configs are dataclasses (5.x: the RoPE fields in ``rope_parameters``, an ``__init__`` of
    each subclass's own, so that a wrapper of the base config's ``__init__`` never runs for a subclass).
    """
    import dataclasses

    from transformers import PretrainedConfig

    return dataclasses.is_dataclass(PretrainedConfig)


class PetalsNotInstalledError(ImportError):
    """hivemind or petals cannot be imported in this Python."""


def import_petals():
    """Import and return the ``petals`` module, every client patch applied (the one way to
    import petals, and the one entry to :func:`~dist_eval.backends.patches.apply_client_patches`).
    An :class:`~dist_eval.backends.patches.UnsupportedPetalsError` for other petals/hivemind versions.
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


@contextlib.contextmanager
def no_random_init_of_meta_tensors():
    """Within: ``torch.nn.init.normal_`` leaves meta tensors alone.

    transformers builds a model's modules on the meta device before it loads their
    weights; ``nn.Embedding`` then calls ``normal_`` on a meta tensor, which makes torch
    import ``torch._dynamo`` (seconds of CPU in every client and server process) to fill a
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


class _OnlyHeadsNewlyInitialized(logging.Filter):
    """Drops transformers' "... newly initialized: [names]" when every name is a weight of ``heads``."""

    def __init__(self, heads: tuple):
        super().__init__()
        self.heads = heads

    def filter(self, record: logging.LogRecord) -> bool:
        import ast
        import re

        found = re.search(r"newly initialized: (\[[^\]]*\])", record.getMessage())
        if found is None:
            return True
        try:
            names = ast.literal_eval(found.group(1))
        except (ValueError, SyntaxError):
            return True
        return not names or not all(str(name).split(".")[0] in self.heads for name in names)


@contextlib.contextmanager
def heads_read_after(*heads: str):
    """Within: transformers' "Some weights of ... were not initialized from the model checkpoint ... and are newly
    initialized: [...]" dropped where every weight it names is of ``heads`` (top-level modules: the classifier's,
    a causal LM's), which the load reads right after (the trained head, a release's LM head saved under another
    name) or refuses where there is none: noise for any caller of ``load_model``, whose logging is left as it
    is (a filter on transformers' loading logger, for the load alone). A block's weight missing is said as ever.
    """
    logger = logging.getLogger("transformers.modeling_utils")
    only_heads = _OnlyHeadsNewlyInitialized(heads)
    logger.addFilter(only_heads)
    try:
        yield
    finally:
        logger.removeFilter(only_heads)


def quiet_warnings() -> None:
    """Filter two warnings by their message, and nothing else: what :func:`import_petals` does
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
