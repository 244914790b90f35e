"""Optional experiment tracking (``--report-to wandb|tensorboard``): the final metrics,
their confidence intervals, the per-class table and the confusion matrix.

Neither package is a dependency: :func:`check_tracker` refuses a tracker whose package
is missing when the config is validated, before any work, with the fix in one line.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Dict, Optional, Union

from dist_eval.errors import UsageError
from dist_eval.output.report_facts import ReportFacts

TRACKERS = ("none", "wandb", "tensorboard")
# tracker -> (the module it needs, how to install it)
_NEEDS = {"wandb": ("wandb", "pip install wandb"), "tensorboard": ("tensorboard", "pip install tensorboard")}


def check_tracker(report_to: str) -> None:
    """Raise :class:`UsageError` unless ``report_to`` is ``none`` or its package is importable."""
    if report_to not in TRACKERS:
        raise UsageError(f"--report-to {report_to}: expected one of {', '.join(TRACKERS)}.")
    if report_to == "none":
        return
    module, fix = _NEEDS[report_to]
    if importlib.util.find_spec(module) is None:
        raise UsageError(
            f"--report-to {report_to}: the {module} package is not installed in this environment "
            f"({sys.executable}). Install it ({fix}) or pass --report-to none."
        )


def scalars_of(report: Union[dict, ReportFacts]) -> Dict[str, float]:
    """The flat scalars a tracker logs: main metrics, CI bounds, per-class F1."""
    facts = ReportFacts.of(report)
    metrics, intervals = facts.metrics, facts.intervals
    out = {name: float(metrics[name]) for name in facts.headline}
    out["num_samples"] = float(metrics["num_samples"])
    for name in facts.interval_names:
        out[f"{name}_ci_low"], out[f"{name}_ci_high"] = (float(v) for v in intervals[name])
    for name, values in metrics.get("per_class", {}).items():
        out[f"per_class/{name}/f1"] = float(values["f1"])
    return out


def log_to_tracker(
    report_to: str, report: Union[dict, ReportFacts], output_dir: str, confusion_png: Optional[str] = None
) -> Optional[str]:
    """Log the final results (``report``: metrics.json's content, or it read); returns where they
    went (None for ``none``).
    """
    if report_to == "none":
        return None
    check_tracker(report_to)
    facts = ReportFacts.of(report)
    log = _log_wandb if report_to == "wandb" else _log_tensorboard
    return log(facts.metrics, scalars_of(facts), output_dir, confusion_png)


def _log_wandb(metrics: dict, scalars: Dict[str, float], output_dir: str, confusion_png: Optional[str]) -> str:
    import wandb

    # project / entity / mode (offline) come from the usual WANDB_* environment variables
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "dist_eval"),
        job_type="eval",
        dir=output_dir,
        config=metrics.get("run", {}),
    )
    payload: dict = dict(scalars)
    columns = ["class", "label", "precision", "recall", "f1", "support"]
    payload["per_class"] = wandb.Table(
        columns=columns,
        data=[
            [name, v["label"], v["precision"], v["recall"], v["f1"], v["support"]]
            for name, v in metrics["per_class"].items()
        ],
    )
    if confusion_png:
        payload["confusion_matrix"] = wandb.Image(confusion_png)
    run.log(payload)
    run.summary.update(scalars)
    where = getattr(run, "url", None) or "wandb"
    run.finish()
    return where


def _log_tensorboard(metrics: dict, scalars: Dict[str, float], output_dir: str, confusion_png: Optional[str]) -> str:
    from torch.utils.tensorboard import SummaryWriter

    from dist_eval.output.per_class import per_class_markdown

    log_dir = os.path.join(output_dir, "tensorboard")
    writer = SummaryWriter(log_dir=log_dir)
    try:
        for name, value in scalars.items():
            writer.add_scalar(name, value, 0)
        writer.add_text("per_class", per_class_markdown(metrics), 0)
        if confusion_png:
            import numpy as np
            from PIL import Image  # installed with matplotlib, which wrote the PNG

            image = np.asarray(Image.open(confusion_png).convert("RGB"))
            writer.add_image("confusion_matrix", image, 0, dataformats="HWC")
    finally:
        writer.close()
    return log_dir
