r"""A node-level Gaussian head for graph neural networks whose outputs must sum to a given total per graph.

A GNN gives node features :math:`h_i` for all nodes of a (PyG-style) mini-batch of graphs; node :math:`i`
belongs to graph :math:`g(i)` (PyG's ``batch`` vector). The head predicts a mean :math:`\mu_i` and a
variance :math:`v_i = \mathrm{softplus}(\cdot) + v_{\min}` per node and returns the diagonal Gaussian
:math:`\mathcal N(\mu, \mathrm{diag}\,v)` conditioned on *one* :class:`~hardeq.SumConstraint` over the whole
batch, :math:`\sum_{i: g(i) = g} z_i = t_g` for every graph :math:`g` -- O(nodes), no loop over graphs.

For this diagonal covariance the conditional is, per graph (:math:`V_g = \sum_{i \in g} v_i`,
:math:`M_g = \sum_{i \in g} \mu_i`):

.. math::

    \bar\mu_i = \mu_i + v_i \, (t_g - M_g) / V_g, \qquad
    \bar v_i = v_i - v_i^2 / V_g,

which is the *variance-weighted charge correction* of Raza et al. (J. Phys. Chem. C 2020); the uniform
correction :math:`\mu_i - (M_g - t_g)/n_g` is the same formula with equal variances (the orthogonal
projection). :func:`per_graph_log_prob` gives the exact log-density on each graph's
:math:`(n_g - 1)`-dimensional plane.

PyG is not needed here: any GNN that yields node features and a ``batch`` vector can use the head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..constraints import SumConstraint
from ..distributions.normal import ConstrainedNormal

__all__ = ["GraphGaussianHead", "graph_normal", "per_graph_log_prob", "variance_weighted_correction"]


def _check_nodes(loc: Tensor, variance: Tensor, batch: Tensor, total: Tensor | float | None,
                 num_graphs: int | None, owner: str) -> tuple[Tensor, int]:
    """Validate per-node ``loc``/``variance`` ``(N,)`` and ``batch``; return ``total`` as a ``(G,)`` tensor and G."""
    for name, t in (("loc", loc), ("variance", variance)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 1:
            raise ValueError(f"{owner}: {name} must have shape (num_nodes,), got {tuple(t.shape)}.")
    if not isinstance(batch, Tensor) or batch.dtype != torch.long:
        raise TypeError(f"{owner}: batch must be a LongTensor of graph ids, got "
                        f"{type(batch).__name__ if not isinstance(batch, Tensor) else batch.dtype}.")
    if batch.shape != loc.shape or variance.shape != loc.shape:
        raise ValueError(f"{owner}: loc, variance and batch must all have shape (num_nodes,), got "
                         f"{tuple(loc.shape)}, {tuple(variance.shape)} and {tuple(batch.shape)}.")
    if num_graphs is None:
        num_graphs = int(batch.max()) + 1 if batch.numel() else 0
    elif not isinstance(num_graphs, int) or num_graphs < 1:
        raise ValueError(f"{owner}: num_graphs must be a positive int, got {num_graphs!r}.")
    if total is None:
        total = torch.zeros(num_graphs, dtype=loc.dtype, device=loc.device)
    elif isinstance(total, (int, float)):
        total = torch.full((num_graphs,), float(total), dtype=loc.dtype, device=loc.device)
    elif not isinstance(total, Tensor):
        raise TypeError(f"{owner}: total must be a Tensor, a number or None, got {type(total).__name__}.")
    else:
        if total.shape != (num_graphs,):
            raise ValueError(f"{owner}: total must have shape (num_graphs,) = ({num_graphs},), got "
                             f"{tuple(total.shape)}.")
        total = total.to(loc.dtype)
    return total, num_graphs


def graph_normal(loc: Tensor, variance: Tensor, batch: Tensor, total: Tensor | float | None = None, *,
                 num_graphs: int | None = None, validate_args: bool | None = None) -> ConstrainedNormal:
    r""":math:`\mathcal N(\mathrm{loc}, \mathrm{diag}\,\mathrm{variance})` given :math:`\sum_{i \in g} z_i = t_g`.

    Args:
        loc: ``(N,)`` per-node means.
        variance: ``(N,)`` per-node variances (positive).
        batch: ``(N,)`` LongTensor, graph id of each node (PyG's ``batch``; every graph non-empty).
        total: ``(G,)`` per-graph totals, a number for all graphs, or ``None`` for 0.
        num_graphs: ``G`` (default ``batch.max() + 1``; pass it to avoid a device sync).

    Returns:
        a :class:`~hardeq.ConstrainedNormal` with ``event_shape = (N,)``: ``.mean`` (the variance-weighted
        correction), ``.variance`` (:math:`v_i - v_i^2/V_g`), ``.rsample``, ``.expected_l1(y)``,
        ``.log_prob(y)`` (the sum over graphs of :func:`per_graph_log_prob`).
    """
    total, _ = _check_nodes(loc, variance, batch, total, num_graphs, "graph_normal")
    return ConstrainedNormal(loc, variance.sqrt(), constraint=SumConstraint(batch, total, validate_args=validate_args),
                             validate_args=validate_args)


def variance_weighted_correction(loc: Tensor, variance: Tensor, batch: Tensor, total: Tensor | float | None = None,
                                 *, num_graphs: int | None = None) -> Tensor:
    r"""Raza et al.'s correction :math:`\mu_i + v_i (t_g - M_g)/V_g`, written directly with scatter sums.

    It equals ``graph_normal(loc, variance, batch, total).mean``, the conditional mean of the diagonal
    Gaussian (the tests check it); kept as a two-line reference. Shapes as :func:`graph_normal`; returns ``(N,)``.
    """
    total, G = _check_nodes(loc, variance, batch, total, num_graphs, "variance_weighted_correction")
    M = loc.new_zeros(G).index_add_(0, batch, loc)
    V = variance.new_zeros(G).index_add_(0, batch, variance)
    return loc + variance * ((total - M) / V)[batch]


def per_graph_log_prob(loc: Tensor, variance: Tensor, batch: Tensor, value: Tensor,
                       total: Tensor | float | None = None, *, num_graphs: int | None = None) -> Tensor:
    r"""Exact log-density of ``value`` on each graph's plane :math:`\{\sum_{i\in g} z_i = t_g\}`, shape ``(G,)``.

    With respect to the :math:`(n_g - 1)`-dimensional Lebesgue measure on the plane (the convention of
    :meth:`ConstrainedNormal.log_prob`, docs/math.md):

    .. math::

        \log p_g = -\tfrac12\Big[(n_g - 1)\log 2\pi + \sum_{i\in g}\log v_i - \log V_g + \log n_g
                   + \sum_{i \in g} (z_i - \bar\mu_i)^2 / v_i\Big].

    The density of the first :math:`n_g - 1` coordinates (the convention of the ICML 2025 code, which
    evaluates a ``MultivariateNormal`` on them) is larger by the Jacobian :math:`\sqrt{n_g}`:
    :math:`\log p_g + \tfrac12 \log n_g`. ``value`` must satisfy the constraint (it is not checked here).

    Args:
        loc, variance, batch, total, num_graphs: as :func:`graph_normal`; value: ``(N,)``.
    """
    total, G = _check_nodes(loc, variance, batch, total, num_graphs, "per_graph_log_prob")
    if not isinstance(value, Tensor) or value.shape != loc.shape:
        raise ValueError(f"per_graph_log_prob: value must be a Tensor of shape {tuple(loc.shape)}, got "
                         f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}.")

    def gsum(x: Tensor) -> Tensor:
        return x.new_zeros(G).index_add_(0, batch, x)

    n = gsum(torch.ones_like(loc))
    V = gsum(variance)
    M = gsum(loc)
    mean = loc + variance * ((total - M) / V)[batch]
    quad = gsum((value - mean).square() / variance)
    return -0.5 * ((n - 1) * math.log(2 * math.pi) + gsum(variance.log()) - V.log() + n.log() + quad)


class GraphGaussianHead(nn.Module):
    r"""Node features to a :class:`~hardeq.ConstrainedNormal` whose samples and mean sum to ``total`` per graph.

    Two linear maps give :math:`\mu_i = w_\mu^\top h_i + b_\mu` and
    :math:`v_i = \mathrm{softplus}(w_v^\top h_i + b_v) + v_{\min}` (a *variance*, as in Raza et al.); the
    result is :func:`graph_normal` over the batch. Train with ``dist.expected_l1(y).mean()`` (closed form per
    node) or ``-dist.log_prob(y)`` (exact NLL on the planes); predict with ``dist.mean``.

    Args:
        in_features: size of the node features.
        min_variance: :math:`v_{\min} \ge 0` added to every variance (0 reproduces Raza et al.'s head).
        dtype: dtype in which the softplus and the conditioning are computed (e.g. ``torch.float64`` for a
            float32 network; the softplus of a very negative input underflows in float32). ``None``: the
            features' dtype.

    Shapes:
        ``h``: ``(N, in_features)``; ``batch``: ``(N,)``; ``total``: ``(G,)``, a number, or ``None`` (0).
        :meth:`forward` returns a distribution with ``event_shape = (N,)``; :meth:`moments` returns
        ``(loc, variance)``, each ``(N,)``.

    Example:
        >>> head = GraphGaussianHead(8)
        >>> batch = torch.tensor([0, 0, 0, 1, 1])
        >>> dist = head(torch.randn(5, 8), batch, torch.tensor([1.0, -2.0]))
        >>> sums = torch.zeros(2).index_add_(0, batch, dist.mean.detach())
        >>> bool(torch.allclose(sums, torch.tensor([1.0, -2.0]), atol=1e-6)), dist.event_shape
        (True, torch.Size([5]))
    """

    def __init__(self, in_features: int, *, min_variance: float = 0.0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}.")
        if not (isinstance(min_variance, (int, float)) and min_variance >= 0):
            raise ValueError(f"min_variance must be a number >= 0, got {min_variance!r}.")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}.")
        self.in_features, self.min_variance, self.dtype = in_features, float(min_variance), dtype
        self.mean = nn.Linear(in_features, 1)
        self.var = nn.Linear(in_features, 1)

    def moments(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Unconstrained per-node ``(loc, variance)``, each ``(N,)``, in the head's ``dtype``."""
        if not isinstance(h, Tensor) or h.dim() != 2 or h.shape[-1] != self.in_features:
            raise ValueError(f"h must have shape (num_nodes, {self.in_features}), got "
                             f"{tuple(h.shape) if isinstance(h, Tensor) else type(h).__name__}.")
        loc = self.mean(h).squeeze(-1)
        raw = self.var(h).squeeze(-1)
        if self.dtype is not None:
            loc, raw = loc.to(self.dtype), raw.to(self.dtype)
        return loc, F.softplus(raw) + self.min_variance

    def forward(self, h: Tensor, batch: Tensor, total: Tensor | float | None = None, *,
                num_graphs: int | None = None) -> ConstrainedNormal:
        loc, variance = self.moments(h)
        return graph_normal(loc, variance, batch, total, num_graphs=num_graphs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, min_variance={self.min_variance}, dtype={self.dtype}"
