"""A generic training harness for many small, independent models (*members*: seeds x methods) trained at once.

* members: :class:`BatchedMLP` (vectorised), :class:`MemberList` (a plain loop over arbitrary modules);
* data: :class:`MemberBatches` (in-memory tensors, per-member shuffling), :class:`LoaderBatches` (any loader);
* :func:`train`: any optimiser and scheduler, per-member best-validation selection, early stopping with
  patience, EMA of weights (with an optional warm-up), gradient clipping, per-epoch or per-step schedules,
  :class:`Hooks` after every step and epoch (checkpointed with the run), batched evaluation with its own
  random stream, atomic checkpoints and a bit-exact ``--resume``, ``torchrun`` data parallelism
  (:mod:`.distributed`). Every study trains through it; ``val_data=None`` trains a fixed budget.
* stopping: :class:`StopRun` (SIGINT / SIGTERM, :func:`stop_on_signals`) and :func:`run_units`, independent
  units in worker processes that all end when the run is asked to stop.
"""

from .checkpoint import (atomic_torch_save, code_fingerprint, code_mismatch, code_stamp, fingerprint, load_checkpoint,
                         run_blocks)
from .data import BatchSource, LoaderBatches, MemberBatches, ShuffledBatches
from .distributed import DistContext, init_distributed
from .loop import Trainer, evaluate, run_fingerprint, train
from .members import BatchedMLP, MemberList, merge_members
from .pool import run_units
from .stop import StopRun, stop_on_signals
from .task import Hooks, Interrupted, Objective, OnEpoch, Task, TrainConfig, TrainResult

__all__ = [
    "BatchSource", "BatchedMLP", "DistContext", "Hooks", "Interrupted", "LoaderBatches", "MemberBatches", "MemberList",
    "Objective", "OnEpoch", "ShuffledBatches", "Task", "TrainConfig", "TrainResult", "Trainer", "atomic_torch_save",
    "code_fingerprint", "code_mismatch", "code_stamp", "evaluate", "fingerprint", "init_distributed",
    "load_checkpoint", "merge_members", "run_blocks", "run_fingerprint", "run_units", "StopRun", "stop_on_signals",
    "train",
]
