"""A generic training harness for many small, independent models (*members*: seeds x methods) trained at once.

* members: :class:`BatchedMLP` (vectorised), :class:`MemberList` (a plain loop over arbitrary modules);
* data: :class:`MemberBatches` (in-memory tensors, per-member shuffling), :class:`LoaderBatches` (any loader);
* :func:`train`: any optimiser and scheduler, per-member best-validation selection, early stopping with
  patience, EMA of weights, batched evaluation with its own random stream, atomic checkpoints and a
  bit-exact ``--resume``, ``torchrun`` data parallelism (:mod:`.distributed`).
"""

from .checkpoint import (atomic_torch_save, code_fingerprint, code_mismatch, code_stamp, fingerprint, load_checkpoint,
                         run_blocks)
from .data import BatchSource, LoaderBatches, MemberBatches
from .distributed import DistContext, init_distributed
from .loop import Trainer, evaluate, train
from .members import BatchedMLP, MemberList, merge_members
from .task import Interrupted, Task, TrainConfig, TrainResult

__all__ = [
    "BatchSource", "BatchedMLP", "DistContext", "Interrupted", "LoaderBatches", "MemberBatches", "MemberList",
    "Task", "TrainConfig", "TrainResult", "Trainer", "atomic_torch_save", "code_fingerprint", "code_mismatch",
    "code_stamp", "evaluate", "fingerprint",
    "init_distributed", "load_checkpoint", "merge_members", "run_blocks", "train",
]
