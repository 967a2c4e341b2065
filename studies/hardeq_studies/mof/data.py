"""The MOF partial-charge graphs (Raza et al. 2020): loading, the charge-sum check, splits, loaders.

``data/mof_graphs.npz`` holds 2266 graphs (see ``data/SOURCE.md``); each becomes a PyG ``Data`` with one-hot
element features ``x`` ``(n, 74)``, both directions of every bond in ``edge_index`` ``(2, 2 b)``, the DDEC
charges ``y`` ``(n,)`` and the element id ``atom_type`` ``(n,)``. Labels sum to 0 only to the file's
precision (|sum| <= 3.2e-5); :func:`load_graphs` projects each graph's labels orthogonally onto its plane
(shifting each charge by ``-sum/n``) so that the exact likelihoods are defined, and reports the shift.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..extras import require

__all__ = ["CONFIG_PATH", "DATA_DIR", "MofData", "load_config", "load_graphs", "make_split", "collate",
           "epoch_batches", "epoch_order", "step_batches",
           "element_means"]

HERE = Path(__file__).resolve().parent
CONFIG_PATH = HERE / "config.json"
DATA_DIR = HERE / "data"
NUM_ELEMENTS = 74


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The study's ``config.json`` (or an alternative file)."""
    return json.loads(Path(path or CONFIG_PATH).read_text())


def pyg():
    """``torch_geometric``, or :class:`~hardeq_studies.extras.MissingDependency` naming ``hardeq-studies[graphs]``."""
    return require("torch_geometric", "graphs", purpose="the mof study (graph batches, GatedGraphConv)")


class MofData:
    """All graphs, with the facts the report quotes.

    Attributes:
        graphs: list of PyG ``Data`` (``x`` float32 one-hot, ``edge_index``, ``y`` float64 projected labels,
            ``atom_type`` long).
        names: MOF names ``(2266,)``.
        element_symbols: the 74 symbols (one-hot column order).
        facts: ``{"num_graphs", "num_atoms", "num_bonds", "max_abs_charge_sum", "mean_abs_charge_sum",
            "atoms_median", "atoms_max", ...}``.
    """

    def __init__(self, graphs: list, names: list[str], element_symbols: list[str], facts: dict[str, Any]) -> None:
        self.graphs, self.names, self.element_symbols, self.facts = graphs, names, element_symbols, facts

    def __len__(self) -> int:
        return len(self.graphs)


def _build(G, node_ptr, edge_ptr, atom_type, charge, edges, eye, geo, graphs, sums, shifts) -> None:
    """Append graph ``g``'s PyG ``Data``, its label sum and its projection shift, for ``g < G``."""
    for g in range(G):
        a, b = int(node_ptr[g]), int(node_ptr[g + 1])
        e0, e1 = int(edge_ptr[g]), int(edge_ptr[g + 1])
        q = charge[a:b]
        s = float(q.sum())
        sums.append(s)
        y = q - q.sum() / (b - a)  # orthogonal projection onto sum = 0
        shifts.append(abs(s) / (b - a))
        ei = edges[:, e0:e1]
        t = atom_type[a:b]
        graphs.append(geo.data.Data(x=eye[t], edge_index=torch.cat([ei, ei.flip(0)], 1), y=y, atom_type=t,
                                    num_nodes=b - a))


@lru_cache(maxsize=2)
def load_graphs(path: str | None = None, limit: int | None = None) -> MofData:
    """Load ``mof_graphs.npz`` as PyG graphs (cached). ``limit``: only the first ``limit`` graphs (tests)."""
    geo = pyg()
    z = np.load(Path(path) if path else DATA_DIR / "mof_graphs.npz")
    node_ptr, edge_ptr = z["node_ptr"], z["edge_ptr"]
    atom_type = torch.from_numpy(z["atom_type"].astype(np.int64))
    charge = torch.from_numpy(z["charge"].astype(np.float64))
    edges = torch.from_numpy(z["edge_index"].astype(np.int64))
    G = len(node_ptr) - 1 if limit is None else min(int(limit), len(node_ptr) - 1)
    eye = torch.eye(NUM_ELEMENTS, dtype=torch.float32)
    graphs, sums, shifts = [], [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: a busy second thread only adds waiting (same results)
    try:
        _build(G, node_ptr, edge_ptr, atom_type, charge, edges, eye, geo, graphs, sums, shifts)
    finally:
        torch.set_num_threads(threads)
    sizes = np.diff(node_ptr[: G + 1])
    facts = {"num_graphs": G, "num_atoms": int(sizes.sum()), "num_bonds": int(edge_ptr[G]),
             "atoms_mean": float(sizes.mean()), "atoms_median": float(np.median(sizes)), "atoms_max": int(sizes.max()),
             "directed_edges_per_atom": float(2 * edge_ptr[G] / sizes.sum()),
             "max_abs_charge_sum": float(np.max(np.abs(sums))), "mean_abs_charge_sum": float(np.mean(np.abs(sums))),
             "max_label_shift": float(max(shifts))}
    return MofData(graphs, [str(n) for n in z["names"][:G]], [str(s) for s in z["element_symbols"]], facts)


def make_split(data: MofData, split_index: int, fractions: tuple[float, float] = (0.7, 0.1), *, base_seed: int = 42,
               max_tries: int = 10_000) -> dict[str, Any]:
    """Split ``split_index`` (0-based): a random 70/10/20 shuffle, redrawn until every element present in the
    test set occurs in the training set (Raza et al.'s rule, as the issue states it).

    The shuffles come from ``random.Random(base_seed)`` drawn ``split_index + 1`` times in sequence (one
    stream, like the ICML code's ``random.seed(42)`` then one shuffle per repetition), so split ``s`` does
    not depend on how many splits are run. Returns ``{"train", "val", "test"}`` (lists of graph indices) and
    ``"redraws"`` (rejected shuffles for this split).
    """
    n = len(data)
    cut_train, cut_val = int(n * fractions[0]), int(n * (fractions[0] + fractions[1]))
    rng = random.Random(base_seed)
    order = list(range(n))
    present = torch.zeros(n, NUM_ELEMENTS, dtype=torch.bool)  # present[g, e]: graph g holds element e
    for g, graph in enumerate(data.graphs):
        present[g, graph.atom_type] = True
    for _ in range(split_index + 1):
        rejected = 0
        while True:
            rng.shuffle(order)
            seen = present[order[:cut_train]].any(0)
            need = present[order[cut_val:]].any(0)
            if not bool((need & ~seen).any()):  # every test element occurs in training
                break
            rejected += 1
            if rejected >= max_tries:
                raise ValueError(f"no split of these {n} graphs puts every test element in the training set "
                                 f"({max_tries} shuffles tried); use more graphs (--graphs).")
    return {"train": order[:cut_train], "val": order[cut_train:cut_val], "test": order[cut_val:],
            "redraws": rejected}


def collate(graphs: list):
    """One PyG ``Batch`` of ``graphs`` (``.batch`` maps atoms to graphs)."""
    return pyg().data.Batch.from_data_list(graphs)


def epoch_order(num_graphs: int, seed: int, epoch: int) -> list[int]:
    """The order of the training graphs in data epoch ``epoch``: a permutation drawn from ``(seed, epoch)``
    alone (so a resumed run draws the same order)."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(int(num_graphs), generator=g).tolist()


def epoch_batches(graphs: list, batch_size: int, seed: int, epoch: int) -> list:
    """The training batches of one data epoch (:func:`epoch_order`) cut into batches of ``batch_size`` graphs
    (the last one smaller)."""
    perm = epoch_order(len(graphs), seed, epoch)
    return [collate([graphs[i] for i in perm[s: s + batch_size]]) for s in range(0, len(graphs), batch_size)]


def step_batches(graphs: list, batch_size: int, seed: int, first: int, count: int) -> list:
    """The batches of optimiser steps ``first, ..., first + count - 1`` of a stream of data epochs.

    Step ``s`` takes batch ``s mod E`` of data epoch ``s div E`` (``E = ceil(len(graphs) / batch_size)``
    batches per epoch, orders from :func:`epoch_order`), so the stream, cut into rounds of any length,
    is the sequence of :func:`epoch_batches`. Cost: one permutation per data epoch touched and one
    ``collate`` per step.
    """
    if first < 0 or count < 0:
        raise ValueError(f"first and count must be non-negative, got first={first}, count={count}.")
    per_epoch = -(-len(graphs) // int(batch_size))
    orders: dict[int, list[int]] = {}
    out = []
    for s in range(int(first), int(first) + int(count)):
        e, j = divmod(s, per_epoch)
        if e not in orders:
            orders[e] = epoch_order(len(graphs), seed, e)
        out.append(collate([graphs[i] for i in orders[e][j * batch_size: (j + 1) * batch_size]]))
    return out


def element_means(graphs: list, variance_floor: float) -> tuple[Tensor, Tensor]:
    """Per-element mean and variance of the training charges, each ``(74,)`` (elements absent from the
    training atoms get mean 0 and the pooled variance; variances are floored at ``variance_floor``)."""
    t = torch.cat([g.atom_type for g in graphs])
    q = torch.cat([g.y for g in graphs])
    cnt = torch.zeros(NUM_ELEMENTS, dtype=torch.float64).index_add_(0, t, torch.ones_like(q))
    s1 = torch.zeros(NUM_ELEMENTS, dtype=torch.float64).index_add_(0, t, q)
    s2 = torch.zeros(NUM_ELEMENTS, dtype=torch.float64).index_add_(0, t, q * q)
    mean = torch.where(cnt > 0, s1 / cnt.clamp_min(1), torch.zeros_like(s1))
    var = torch.where(cnt > 1, (s2 / cnt.clamp_min(1) - mean**2) * cnt / (cnt - 1).clamp_min(1), q.var())
    return mean, var.clamp_min(variance_floor)
