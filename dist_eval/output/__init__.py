"""The run's outputs, written by rank 0 only.

- :mod:`~dist_eval.output.files`: metrics.json, predictions.jsonl and the report files
- :mod:`~dist_eval.output.summary`: the summary printed on the terminal
- :mod:`~dist_eval.output.per_class`: the per-class table (rows, CSV, Markdown)
- :mod:`~dist_eval.output.figures`: confusion_matrix.png (matplotlib, optional)
- :mod:`~dist_eval.output.html`: report.html, self-contained
- :mod:`~dist_eval.output.tracking`: ``--report-to wandb|tensorboard``
"""
