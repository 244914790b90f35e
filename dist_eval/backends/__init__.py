"""Model backends: one small interface, :class:`~dist_eval.backends.base.Backend`.

- :mod:`~dist_eval.backends.base`: :class:`Backend`, what every backend provides (and a minimal one to copy)
- :mod:`~dist_eval.backends.classifier`: :class:`LoadedModel` and :func:`load_model`
- :mod:`~dist_eval.backends.objects`: a model object in memory (petals' or transformers'
  sequence classifier, as a training loop holds it) as the LoadedModel ``load_model`` gives
- :mod:`~dist_eval.backends.families`: what differs between model families, in one table
- :mod:`~dist_eval.backends.checkpoint`: the trained prompts + head, read from every form users hold
- :mod:`~dist_eval.backends.petals_folder`: a model folder in the layout petals' server and client read
- :mod:`~dist_eval.backends.local`: the same model computed in-process (the reference)
- :mod:`~dist_eval.backends.petals`: blocks on a swarm (petals imported lazily)
- :mod:`~dist_eval.backends.requests`: a batch goes as one request, split only to what a server accepts
- :mod:`~dist_eval.backends.failover`: routing around failed servers; naming unserved blocks
- :mod:`~dist_eval.backends.wire`: what a forward sends to the swarm and gets back (both halves)
- :mod:`~dist_eval.backends.helpers`: the petals client's helper processes, and a watch over them
- :mod:`~dist_eval.backends.patches`: every change dist_eval makes to petals and hivemind, applied in one place
- :mod:`~dist_eval.backends.compat`: importing petals (the one way: every client patch), and its side effects

The names below are imported on first use: ``dist_eval.swarm`` reads model folders with
:mod:`~dist_eval.backends.petals_folder` and must not import torch by running this file.
"""
import importlib

_EXPORTS = {"Backend": "dist_eval.backends.base", "LoadedModel": "dist_eval.backends.classifier",
            "load_model": "dist_eval.backends.classifier"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dist_eval.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
