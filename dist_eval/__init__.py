"""dist_eval: exact, sharded evaluation of classifiers served by a Petals swarm.

    torchrun --nproc_per_node=N -m dist_eval [flags]      # the CLI
    from dist_eval import evaluate, load_model            # the Python API
"""
from dist_eval.backends import LoadedModel, load_model
from dist_eval.errors import UsageError
from dist_eval.run import EvalResult, evaluate

__version__ = "0.1.0"
__all__ = ["evaluate", "EvalResult", "load_model", "LoadedModel", "UsageError", "__version__"]
