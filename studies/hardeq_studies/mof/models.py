"""Raza et al.'s message-passing network: element embedding, GatedGraphConv, a per-atom mean and variance.

    x (one-hot, 74) --Linear(74 -> E, no bias)--> sigmoid --zero-pad to H--> GatedGraphConv(H, T steps,
    sum aggregation of W_t h_j, GRUCell update) --> ReLU --> GraphGaussianHead: mu_i, v_i = softplus(.)

The head is :class:`hardeq.nn.GraphGaussianHead`; it computes the softplus (and everything after it) in
float64 while the network runs in float32 (the ICML code runs all in float64, 1.8x slower on the CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hardeq.nn import GraphGaussianHead
from .data import NUM_ELEMENTS, pyg

__all__ = ["MofMPNN", "build_member"]


class MofMPNN(nn.Module):
    """One member network. ``forward(batch)`` returns ``(N, 2)`` float64: columns ``mu`` and ``variance``.

    Args:
        embedding: ``E``; hidden: ``H`` (``H >= E``); steps: ``T``, GatedGraphConv's propagation steps.
    """

    def __init__(self, embedding: int, hidden: int, steps: int) -> None:
        super().__init__()
        if not (1 <= embedding <= hidden) or steps < 1:
            raise ValueError(f"need 1 <= embedding <= hidden and steps >= 1, got E={embedding}, H={hidden}, T={steps}.")
        self.embed = nn.Linear(NUM_ELEMENTS, embedding, bias=False)
        self.conv = pyg().nn.GatedGraphConv(hidden, steps, aggr="add")
        self.head = GraphGaussianHead(hidden, dtype=torch.float64)

    def forward(self, batch) -> Tensor:
        h = torch.sigmoid(self.embed(batch.x))
        h = torch.relu(self.conv(h, batch.edge_index))
        mu, var = self.head.moments(h)
        return torch.stack([mu, var], dim=-1)


def build_member(arch: dict, seed: int) -> MofMPNN:
    """A member with architecture ``{"embedding", "hidden", "steps"}`` initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return MofMPNN(int(arch["embedding"]), int(arch["hidden"]), int(arch["steps"]))
