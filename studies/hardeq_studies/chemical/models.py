"""The network of the ``chemical`` study: every method x every seed as one :class:`BatchedMLP`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..harness import BatchedMLP
from .task import ChemicalTask

__all__ = ["build_model"]


def build_model(task: ChemicalTask, in_features: int, seeds: Sequence[int], model_config: Mapping[str, Any], *,
                dtype: torch.dtype, device: torch.device | str) -> BatchedMLP:
    """The batched MLP of all members of ``task`` (``model_config``: ``hidden`` sizes and ``activation``).

    Member ``j`` of every method is initialised from ``seeds[j]`` (see :class:`BatchedMLP`): the hidden
    layers agree across methods, and with ``same_init`` so do the mean outputs of the ``ours*`` variants and
    the baselines' outputs. ECNN's output layer has ``n - a`` outputs: its weights are the first ``n - a``
    rows of the baselines' layer, its biases the ones ``nn.Linear(h, n - a)`` draws.
    """
    return BatchedMLP(in_features, model_config["hidden"], task.out_sizes, task.member_seeds(seeds),
                      base_out_features=task.base_out_sizes, detach_outputs=task.detach_outputs,
                      bias_only_outputs=task.bias_only_outputs, activation=model_config["activation"],
                      dtype=dtype, device=device)
