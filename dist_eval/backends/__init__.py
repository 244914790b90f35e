"""Model backends: one small interface, :class:`~dist_eval.backends.base.Backend`.

- :mod:`~dist_eval.backends.base`: :class:`Backend`, what every backend provides (and a minimal one to copy)
- :mod:`~dist_eval.backends.classifier`: :class:`LoadedModel` and :func:`load_model`
- :mod:`~dist_eval.backends.objects`: a model object in memory (petals' or transformers'
  sequence classifier, as a training loop holds it) as the LoadedModel ``load_model`` gives
- :mod:`~dist_eval.backends.families`: what differs between model families, in one table
- :mod:`~dist_eval.backends.checkpoint`: the trained prompts + head, read from every form users hold
- :mod:`~dist_eval.backends.petals_folder`: a model folder in the layout petals' server and client read
- :mod:`~dist_eval.backends.local`: the same model computed in-process (the reference)
- :mod:`~dist_eval.backends.petals`: blocks on a swarm: the petals backend, its requests, failover, audit, the
  wire's client half, the client's helper processes, and every change dist_eval makes to petals (petals imported
  lazily)
- :mod:`~dist_eval.backends.compat`: what dist_eval's own code needs of the installed transformers; quieting

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
