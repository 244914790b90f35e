"""The data, in the order it flows: load -> check columns and labels -> plan global batches
-> shard the batches over the ranks -> tokenize this rank's rows -> right-pad.

- :mod:`~dist_eval.data.load`: a split from files, a ``save_to_disk`` folder or the hub
- :mod:`~dist_eval.data.labels`: the task's columns; labels as class ids
- :mod:`~dist_eval.data.batches`: the global batch plan and each rank's batch ids
- :mod:`~dist_eval.data.tokenize`: token ids of rows; right-padded batches
- :mod:`~dist_eval.data.shard`: this rank's batches of a Dataset
- :mod:`~dist_eval.data.loader`: this rank's batches of a user DataLoader (indices from its sampler)
"""
from dist_eval.data.batches import plan_batches, shard_batch_ids
from dist_eval.data.labels import TaskColumns, check_columns, label_names_of, read_labels
from dist_eval.data.load import load_split
from dist_eval.data.tokenize import right_pad, tokenize_rows

__all__ = [
    "plan_batches", "shard_batch_ids", "TaskColumns", "check_columns", "label_names_of", "read_labels",
    "load_split", "right_pad", "tokenize_rows",
]
