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
projection). The returned :class:`GraphNormal` is a :class:`~hardeq.ConstrainedNormal` over all nodes whose
:meth:`~GraphNormal.log_prob` and :meth:`~GraphNormal.entropy` are per graph, shape ``(num_graphs,)`` (the joint
values are their sums): the exact log-density on each graph's :math:`(n_g - 1)`-dimensional plane, as
:func:`per_graph_log_prob`.

PyG is not needed here: any GNN that yields node features and a ``batch`` vector can use the head.
"""

from __future__ import annotations

import math
from types import EllipsisType
from typing import TYPE_CHECKING, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch.distributions.utils import lazy_property

from .._utils import LOG_2PI, assert_deferred
from ..constraints import SumConstraint
from ..distributions.normal import HALF_DTYPES, ConstrainedNormal
from ._device import DeviceCheckedModule
from .heads import check_bound, check_bounds, training_mode, truncate

if TYPE_CHECKING:
    from ..bounds.training import PersistentChains
    from ..distributions.truncated import TruncatedConstrainedNormal

#: the (deferred) error of a log-normaliser that is not finite
NONFINITE_NORMALISER = ("variance must be positive and finite for log_prob and entropy, but the log-normaliser of a "
                        "graph is not finite (a zero variance?).")

__all__ = ["GraphGaussianHead", "GraphNormal", "graph_normal", "per_graph_log_prob", "variance_weighted_correction"]


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
    elif isinstance(total, (int, float)) and not isinstance(total, bool):
        total = torch.full((num_graphs,), float(total), dtype=loc.dtype, device=loc.device)
    elif not isinstance(total, Tensor) or total.dtype == torch.bool or total.is_complex():
        what = total.dtype if isinstance(total, Tensor) else type(total).__name__
        raise TypeError(f"{owner}: total must be a floating / integer Tensor, a number or None, got {what}.")
    else:
        try:
            ok = torch.broadcast_shapes(total.shape, (num_graphs,)) == (num_graphs,)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{owner}: total must have shape (num_graphs,) = ({num_graphs},), or broadcast to it "
                             f"(a number, () or (1,)), got {tuple(total.shape)}.")
        if total.device != loc.device:
            raise ValueError(f"{owner}: total is on device {total.device} but loc is on {loc.device}.")
        total = total.to(loc.dtype).expand(num_graphs)
    return total, num_graphs


class GraphNormal(ConstrainedNormal):
    r""":math:`\mathcal N(\mathrm{loc}, \mathrm{diag}\,\mathrm{variance})` over the nodes of a batch of graphs,
    given :math:`\sum_{i \in g} z_i = t_g` for every graph :math:`g`, with per-graph densities.

    A :class:`~hardeq.ConstrainedNormal` with ``event_shape = (N,)`` (nodes) and one
    :class:`~hardeq.SumConstraint` over ``batch``: ``.mean``, ``.variance``, ``.rsample``, ``.expected_l1(y)`` and
    ``kl_divergence`` are those of the joint law (per node, or the batch total for the KL). Because the graphs are
    independent given their totals, the joint log-density is a sum over graphs, and :meth:`log_prob` and
    :meth:`entropy` return the terms, **one per graph**, shape ``(*sample, *batch, num_graphs)``: the per-graph
    NLL of a PyG mini-batch is ``-dist.log_prob(y)`` and the joint value its ``.sum(-1)``.

    Args:
        loc: ``(N,)`` per-node means.
        variance: ``(N,)`` per-node variances (positive).
        batch: ``(N,)`` LongTensor, graph id of each node (PyG's ``batch``; every graph non-empty).
        total: ``(G,)`` per-graph totals, or anything that broadcasts to it (a number, ``()``, ``(1,)``), or
            ``None`` for 0.
        num_graphs: ``G`` (default ``batch.max() + 1``; pass it to avoid a device sync).
        validate_args: as in ``torch.distributions``.

    Examples:
        >>> from hardeq.nn import GraphNormal
        >>> batch = torch.tensor([0, 0, 0, 1, 1])  # graph of each node
        >>> d = GraphNormal(torch.zeros(5), torch.ones(5), batch, torch.tensor([3.0, -2.0]))
        >>> _ = torch.manual_seed(0)
        >>> z = d.rsample((4,))
        >>> z.shape, d.log_prob(z).shape, bool(d.constraint.check(z).all())  # one log-density per graph
        (torch.Size([4, 5]), torch.Size([4, 2]), True)
    """

    def __init__(self, loc: Tensor, variance: Tensor, batch: Tensor, total: Tensor | float | None = None, *,
                 num_graphs: int | None = None, validate_args: bool | None = None) -> None:
        total, G = _check_nodes(loc, variance, batch, total, num_graphs, "graph_normal")
        super().__init__(loc, variance.sqrt(), constraint=SumConstraint(batch, total, validate_args=validate_args),
                         validate_args=validate_args)
        #: graph id of each node, ``(N,)``, and the number of graphs ``G``
        self.graph_index, self.num_graphs = batch, G
        self._node_variance = variance.to(torch.float32) if variance.dtype in HALF_DTYPES else variance

    def expand(self, batch_shape: torch.Size | list[int] | tuple[int, ...], _instance: Self | None = None) -> Self:
        new: Self = self._get_checked_instance(  # type: ignore[no-untyped-call]  # torch: unannotated helper
            GraphNormal, _instance)
        new = super().expand(batch_shape, _instance=new)
        new.graph_index, new.num_graphs, new._node_variance = self.graph_index, self.num_graphs, self._node_variance
        return new

    def _graph_sum(self, x: Tensor) -> Tensor:
        """``(..., N) -> (..., G)``: the sum over each graph's nodes."""
        return x.new_zeros(x.shape[:-1] + (self.num_graphs,)).index_add_(-1, self.graph_index, x)

    @lazy_property
    def _graph_log_normaliser(self) -> Tensor:
        r""":math:`-\tfrac12[(n_g - 1)\log 2\pi + \sum_{i\in g}\log v_i - \log V_g + \log n_g]`, ``(G,)``."""
        v = self._node_variance
        n_g = self._graph_sum(torch.ones_like(v))
        out = -0.5 * ((n_g - 1) * LOG_2PI + self._graph_sum(v.log()) - self._graph_sum(v).log() + n_g.log())

        def named() -> ValueError:
            bad = (~torch.isfinite(out)).nonzero().flatten()[:4].tolist()
            return ValueError(f"variance must be positive and finite for log_prob and entropy, but the log-normaliser "
                              f"of graph(s) {bad} is not finite (a zero variance?).")

        # (no host read: on a GPU the error comes at the next synchronisation; a CPU raises it at once, named)
        assert_deferred(torch.isfinite(out).all(), NONFINITE_NORMALISER, named)
        return out

    def log_prob(self, value: Tensor) -> Tensor:
        r"""Log-density of ``value`` on each graph's plane, shape ``(*sample, *batch, num_graphs)``; the joint
        log-density (:meth:`ConstrainedNormal.log_prob <hardeq.ConstrainedNormal.log_prob>`) is its sum.

        .. math::
            \log p_g(z) = -\tfrac12\Big[(n_g - 1)\log 2\pi + \sum_{i\in g}\log v_i - \log V_g + \log n_g
            + \sum_{i \in g} (z_i - \bar\mu_i)^2 / v_i\Big],

        w.r.t. the :math:`(n_g - 1)`-dimensional Lebesgue measure on the plane (counting measure for a one-node
        graph, whose value is pinned: :math:`\log p_g = 0` there). :math:`z - \bar\mu` is formed as
        :math:`(z - \mu) - v\,(t - M)/V` with :math:`t_g - M_g` accumulated in float64, so a mean far from
        the plane loses nothing in float32. ``value``: ``(..., N)``, checked as in
        :meth:`ConstrainedNormal.log_prob <hardeq.ConstrainedNormal.log_prob>` (off the planes a ``ValueError``
        with validation on). Cost: O(N) per sample.
        """
        original = value
        value = self._as_event("value", value)
        if self._validate_args:
            self._validate_sample(original)
        loc, v = self._unbroadcasted_loc, self._node_variance
        wide = torch.float64 if loc.dtype in (torch.float16, torch.bfloat16, torch.float32) else loc.dtype
        r = (self.constraint.k.to(wide) - self._graph_sum(loc.to(wide))).to(loc.dtype)  # t - M, (*batch, G)
        d = (value - loc) - v * (r / self._graph_sum(v)).index_select(-1, self.graph_index)
        out = self._graph_log_normaliser - 0.5 * self._graph_sum(d * d / v)
        return self._out(out)

    def entropy(self) -> Tensor:
        r"""Per-graph entropy :math:`\tfrac{n_g - 1}{2} - \log` (the normaliser of :meth:`log_prob`), shape
        ``(*batch, num_graphs)``; 0 for a one-node graph. The joint entropy is its sum."""
        out = 0.5 * (self._graph_sum(torch.ones_like(self._node_variance)) - 1) - self._graph_log_normaliser
        return self._out(out).expand(self.batch_shape + (self.num_graphs,))

    def __repr__(self) -> str:
        return f"GraphNormal(num_nodes={self.event_shape[0]}, num_graphs={self.num_graphs})"


def graph_normal(loc: Tensor, variance: Tensor, batch: Tensor, total: Tensor | float | None = None, *,
                 num_graphs: int | None = None, validate_args: bool | None = None) -> GraphNormal:
    r""":math:`\mathcal N(\mathrm{loc}, \mathrm{diag}\,\mathrm{variance})` given :math:`\sum_{i \in g} z_i = t_g`.

    Args:
        loc: ``(N,)`` per-node means.
        variance: ``(N,)`` per-node variances (positive).
        batch: ``(N,)`` LongTensor, graph id of each node (PyG's ``batch``; every graph non-empty).
        total: ``(G,)`` per-graph totals (or broadcastable to it: a number, ``()``, ``(1,)``), or ``None`` for 0.
        num_graphs: ``G`` (default ``batch.max() + 1``; pass it to avoid a device sync).

    Returns:
        a :class:`GraphNormal` (a :class:`~hardeq.ConstrainedNormal` with ``event_shape = (N,)``): ``.mean`` (the
        variance-weighted correction), ``.variance`` (:math:`v_i - v_i^2/V_g`), ``.rsample``, ``.expected_l1(y)``,
        and ``.log_prob(y)`` / ``.entropy()`` per graph, shape ``(G,)`` (their sums are the joint values).

    Examples:
        >>> from hardeq.nn import graph_normal
        >>> batch = torch.tensor([0, 0, 0, 1, 1])
        >>> d = graph_normal(torch.tensor([1.0, 2.0, 3.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 2.0, 1.0, 3.0]), batch,
        ...                  torch.tensor([2.0, 5.0]))
        >>> torch.allclose(d.mean, torch.tensor([0.0, 1.0, 1.0, 1.0, 4.0]), atol=1e-6), d.variance
        (True, tensor([0.7500, 0.7500, 1.0000, 0.7500, 0.7500]))
    """
    return GraphNormal(loc, variance, batch, total, num_graphs=num_graphs, validate_args=validate_args)


def variance_weighted_correction(loc: Tensor, variance: Tensor, batch: Tensor, total: Tensor | float | None = None,
                                 *, num_graphs: int | None = None) -> Tensor:
    r"""Raza et al.'s correction :math:`\mu_i + v_i (t_g - M_g)/V_g`, written directly with scatter sums.

    It equals ``graph_normal(loc, variance, batch, total).mean``, the conditional mean of the diagonal
    Gaussian (the tests check it); kept as a two-line reference. Shapes as :func:`graph_normal`; returns ``(N,)``.

    Examples:
        >>> from hardeq.nn import variance_weighted_correction
        >>> loc, variance = torch.tensor([1.0, 2.0, 3.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 2.0, 1.0, 3.0])
        >>> variance_weighted_correction(loc, variance, torch.tensor([0, 0, 0, 1, 1]), torch.tensor([2.0, 5.0]))
        tensor([0., 1., 1., 1., 4.])
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

    Examples:
        >>> from hardeq.nn import graph_normal, per_graph_log_prob
        >>> loc, variance, batch = torch.zeros(5), torch.ones(5), torch.tensor([0, 0, 0, 1, 1])
        >>> value = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])  # on the planes: sums 3 and 0
        >>> lp = per_graph_log_prob(loc, variance, batch, value, torch.tensor([3.0, 0.0]))
        >>> [round(float(x), 4) for x in lp], bool(torch.allclose(lp, graph_normal(loc, variance, batch,
        ...                                                   torch.tensor([3.0, 0.0])).log_prob(value)))
        ([-1.8379, -0.9189], True)
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


class GraphGaussianHead(DeviceCheckedModule):
    r"""Node features to a :class:`~hardeq.ConstrainedNormal` whose samples and mean sum to ``total`` per graph.

    Two linear maps give :math:`\mu_i = w_\mu^\top h_i + b_\mu` and
    :math:`v_i = \mathrm{softplus}(w_v^\top h_i + b_v) + v_{\min}` (a *variance*, as in Raza et al.); the
    result is :func:`graph_normal` over the batch, a :class:`GraphNormal`. Train with ``dist.expected_l1(y).mean()``
    (closed form per node) or ``-dist.log_prob(y).mean()`` (exact NLL on the planes, one value per graph);
    predict with ``dist.mean``.

    The per-graph totals are given per call or fixed at construction (a call's value wins; neither means 0): a
    Python number, or a floating / integer tensor that broadcasts to ``(num_graphs,)`` (``()``, ``(1,)`` or
    ``(G,)``), as :class:`~hardeq.nn.ConstrainedGaussianHead` takes its ``constraint_value``.

    **Bounds.** With ``lower`` and / or ``upper`` (e.g. ``lower=0.0`` for non-negative node quantities that sum
    to a total per graph) the head returns ``graph_normal(...).truncate(lower, upper)``, a
    :class:`~hardeq.TruncatedConstrainedNormal` over all nodes: exactly feasible samples (every node within its
    bounds, every graph's sum to round-off), the constrained ``mode``, and the joint restricted ``log_prob``
    (one value per sample, not per graph: the truncation couples nothing across graphs, but the normaliser is
    the sampler's, docs/bounds.md; in ``train()`` with grad on, ``log_prob`` is the unnormalised density whose
    gradient comes from the head's persistent chains, :class:`~hardeq.nn.ConstrainedGaussianHead` says more). At
    construction a bound is a number (the same for every node; the number of
    nodes changes from batch to batch); a call may pass ``(N,)`` tensors, which replace the head's.

    Args:
        in_features: size of the node features.
        total: a fixed total for every call that passes none (e.g. ``0.0`` for neutral molecules); a tensor is
            stored as a buffer.
        min_variance: :math:`v_{\min} \ge 0` added to every variance (0 reproduces Raza et al.'s head).
        dtype: dtype in which the softplus and the conditioning are computed (e.g. ``torch.float64`` for a
            float32 network; the softplus of a very negative input underflows in float32). ``None``: the
            features' dtype.
        lower, upper: a number (every node), ``-inf`` / ``inf`` or ``None`` (default: unbounded, the head returns
            the :class:`GraphNormal` itself).

    Shapes:
        ``h``: ``(N, in_features)``; ``batch``: ``(N,)``; ``total``: ``(G,)`` or broadcastable to it, a number, or
        ``None`` (the fixed total, else 0). :meth:`forward` returns a :class:`GraphNormal` with
        ``event_shape = (N,)`` whose ``log_prob`` is ``(G,)``; :meth:`moments` returns ``(loc, variance)``, each
        ``(N,)``.

    Example:
        >>> head = GraphGaussianHead(8)
        >>> batch = torch.tensor([0, 0, 0, 1, 1])
        >>> dist = head(torch.randn(5, 8), batch, torch.tensor([1.0, -2.0]))
        >>> sums = torch.zeros(2).index_add_(0, batch, dist.mean.detach())
        >>> bool(torch.allclose(sums, torch.tensor([1.0, -2.0]), atol=1e-6)), dist.event_shape
        (True, torch.Size([5]))
        >>> dist.log_prob(dist.sample()).shape  # one log-density per graph
        torch.Size([2])
    """

    def __init__(self, in_features: int, *, total: Tensor | float | None = None, min_variance: float = 0.0,
                 dtype: torch.dtype | None = None, lower: Tensor | float | None = None,
                 upper: Tensor | float | None = None) -> None:
        super().__init__()
        if not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}.")
        if not (isinstance(min_variance, (int, float)) and min_variance >= 0):
            raise ValueError(f"min_variance must be a number >= 0, got {min_variance!r}.")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}.")
        self.in_features, self.min_variance, self.dtype = in_features, float(min_variance), dtype
        if total is not None:
            if isinstance(total, (int, float)) and not isinstance(total, bool):
                total = torch.tensor(float(total))
            elif not isinstance(total, Tensor) or total.dtype == torch.bool or total.is_complex():
                what = total.dtype if isinstance(total, Tensor) else type(total).__name__
                raise TypeError(f"total must be a floating / integer Tensor, a number or None, got {what}.")
            elif total.dim() > 1:
                raise ValueError(f"total must have shape (), (1,) or (num_graphs,), got {tuple(total.shape)}.")
            else:
                total = total.detach().clone()
        self.total: Tensor | None  # buffers (typed here: nn.Module's attribute lookup says Tensor | Module)
        self.lower: Tensor | None
        self.upper: Tensor | None
        self.register_buffer("total", total)
        lower = check_bound(lower, "lower", None, "GraphGaussianHead")
        upper = check_bound(upper, "upper", None, "GraphGaussianHead")
        for name, b in (("lower", lower), ("upper", upper)):
            if b is not None and b.numel() != 1:
                raise ValueError(f"GraphGaussianHead: {name} must be a number at construction (the number of nodes "
                                 f"changes from batch to batch; pass per-node (N,) bounds per call), got shape "
                                 f"{tuple(b.shape)}.")
        lower, upper = (None if b is None else b.reshape(()) for b in (lower, upper))
        check_bounds(lower, upper, "GraphGaussianHead")
        self.register_buffer("lower", lower)
        self.register_buffer("upper", upper)
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
                num_graphs: int | None = None, lower: Tensor | float | EllipsisType | None = ...,
                upper: Tensor | float | EllipsisType | None = ..., training: bool | PersistentChains | None = None
                ) -> GraphNormal | TruncatedConstrainedNormal:
        """The :class:`GraphNormal` of the nodes ``h`` ``(N, in_features)`` of the graphs ``batch`` ``(N,)`` with
        totals ``total`` (default: the head's, else 0); truncated to ``[lower, upper]`` when a bound is in force
        (``lower`` / ``upper``: a number or ``(N,)``, replacing the head's for this call; ``None``: no such
        bound; omitted: the head's). ``training``: the truncated law's training mode, as
        :class:`~hardeq.nn.ConstrainedGaussianHead` (default: the head's persistent chains in ``train()`` with grad
        on, the normalised density in ``eval()`` or under ``torch.no_grad()``)."""
        lower = self.lower if lower is ... else check_bound(lower, "lower", h.shape[0], "forward")
        upper = self.upper if upper is ... else check_bound(upper, "upper", h.shape[0], "forward")
        check_bounds(lower, upper, "forward")
        loc, variance = self.moments(h)
        total = self.total if total is None else total
        return truncate(GraphNormal(loc, variance, batch, total, num_graphs=num_graphs), lower, upper,
                        training_mode(self, training))

    def extra_repr(self) -> str:
        fixed = "" if self.total is None else f", total={tuple(self.total.shape)}"
        for name in ("lower", "upper"):
            if getattr(self, name) is not None:
                fixed += f", {name}={float(getattr(self, name)):g}"
        return f"in_features={self.in_features}, min_variance={self.min_variance}, dtype={self.dtype}{fixed}"
