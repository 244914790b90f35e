"""dist_eval: exact, sharded evaluation of classifiers served by a Petals swarm.

    torchrun --nproc_per_node=N -m dist_eval [flags]      # the CLI
    from dist_eval import evaluate, load_model            # the Python API

The names below are imported on first use, so that ``python -m dist_eval.swarm`` (the
standard library only) does not import torch.
"""
import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "evaluate": "dist_eval.evaluation",
    "evaluate_pair": "dist_eval.evaluation",
    "EvalResult": "dist_eval.evaluation",
    "load_model": "dist_eval.backends.classifier",
    "LoadOptions": "dist_eval.backends.arguments",
    "LoadedModel": "dist_eval.backends.classifier",
    "load_tokenizer": "dist_eval.backends.tokenizer",
    "UsageError": "dist_eval.errors",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dist_eval' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
