r"""Regression heads that return a :class:`~hardeq.ConstrainedNormal`, or with bounds its truncation
:class:`~hardeq.TruncatedConstrainedNormal`."""

from __future__ import annotations

import numbers
from types import EllipsisType
from typing import TYPE_CHECKING, SupportsFloat, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..bounds.training import PersistentChains
from ..constraints import EqualityConstraint, LinearConstraint, SumConstraint
from ..distributions.normal import ConstrainedNormal
from ._device import DeviceCheckedModule

if TYPE_CHECKING:
    from ..distributions.truncated import TruncatedConstrainedNormal

_N = TypeVar("_N", bound=ConstrainedNormal)

__all__ = ["ConstrainedGaussianHead"]


def check_bound(value: object, name: str, n: int | None, owner: str) -> Tensor | None:
    """A head's ``lower`` / ``upper`` as ``None`` or a floating tensor: a Python number (``0.0``, ``-inf``) becomes a
    0-dim float64 tensor; a tensor must be floating or integer, broadcast to ``(n,)`` in its last dimension (size
    1 or ``n``; any leading dimensions broadcast with the batch at the call) and hold no NaN. ``TypeError`` /
    ``ValueError`` naming ``name``, the expectation and what arrived."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = torch.tensor(float(value), dtype=torch.float64)
    elif not isinstance(value, Tensor) or value.dtype == torch.bool or value.is_complex():
        what = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"{owner}: {name} must be None, a Python number or a floating / integer torch.Tensor, got "
                        f"{what}.")
    if n is not None and value.dim() > 0 and value.shape[-1] not in (1, n):
        raise ValueError(f"{owner}: {name} must be a number or a tensor whose last dimension is 1 or {n} (one bound "
                         f"per output), got shape {tuple(value.shape)}.")
    value = value.detach().clone()
    if not value.is_floating_point():
        value = value.to(torch.get_default_dtype())
    if bool(torch.isnan(value).any()):
        raise ValueError(f"{owner}: {name} must not hold NaN (use -inf / +inf for no bound), got {value}.")
    return value


def check_bounds(lower: Tensor | None, upper: Tensor | None, owner: str) -> None:
    """``lower <= upper`` wherever both are given (``ValueError`` naming the first offending entry)."""
    if lower is None or upper is None:
        return
    try:
        bad = lower > upper
    except RuntimeError:
        raise ValueError(f"{owner}: lower of shape {tuple(lower.shape)} and upper of shape {tuple(upper.shape)} do "
                         "not broadcast.") from None
    if bool(bad.any()):
        i = tuple(int(j) for j in bad.nonzero()[0]) if bad.dim() else ()
        lo = lower.expand(bad.shape)[i] if bad.dim() else lower
        hi = upper.expand(bad.shape)[i] if bad.dim() else upper
        raise ValueError(f"{owner}: need lower <= upper, got lower = {float(lo)} > upper = {float(hi)} at index "
                         f"{list(i)}.")


def training_mode(module: nn.Module, training: object) -> bool | PersistentChains:
    """The ``training=`` a head passes to :meth:`~hardeq.ConstrainedNormal.truncate`: ``None`` (a head's default)
    is the module's own :class:`~hardeq.bounds.PersistentChains` while the module is in training mode
    (``module.train()``, the default of a new module) *and* grad mode is on, else ``False`` (the normalised
    ``log_prob``: in ``module.eval()`` or under ``torch.no_grad()``); ``True`` is the module's own chains (kept on
    the module across calls, so they persist from step to step); ``False`` or a :class:`PersistentChains` is passed
    on as given. ``TypeError`` otherwise."""
    if training is None:
        training = module.training and torch.is_grad_enabled()
        if not training:
            return False
    if training is True:
        chains = module.__dict__.get("_persistent_chains")
        if chains is None:
            chains = module.__dict__["_persistent_chains"] = PersistentChains()
        return cast(PersistentChains, chains)
    if training is False or isinstance(training, PersistentChains):
        return training
    raise TypeError(f"training must be None, a bool or a hardeq.bounds.PersistentChains, got "
                    f"{type(training).__name__}.")


def truncate(dist: _N, lower: Tensor | None, upper: Tensor | None,
             training: bool | PersistentChains = False) -> _N | TruncatedConstrainedNormal:
    """``dist`` itself when neither bound is given, else ``dist.truncate(lower, upper, training=training)`` with the
    bounds in the distribution's dtype and device."""
    if lower is None and upper is None:
        return dist
    loc = dist.loc

    def conv(b: Tensor | None) -> Tensor | None:
        return None if b is None else b.to(dtype=loc.dtype, device=loc.device)

    return dist.truncate(conv(lower), conv(upper), training=training)


class ConstrainedGaussianHead(DeviceCheckedModule):
    r"""Features :math:`h` to :math:`\mathcal N(\mu(h), \mathrm{diag}\,\sigma(h)^2)` conditioned on :math:`Az = k`.

    A linear layer predicts a mean and a pre-activation of the scale for each of ``out_features`` outputs,
    :math:`\sigma = \mathrm{softplus}(\cdot) + \sigma_{\min}`; the Gaussian is conditioned on the constraint
    with the right-hand side :math:`k` given per call (e.g. ``k = b - B x`` from the inputs) or fixed at
    construction (``constraint_value=1.0`` for a portfolio whose weights sum to one). Train with
    ``dist.expected_l2(y)`` / ``dist.expected_l1(y)`` (closed forms) or ``-dist.log_prob(y)``; predict with
    ``dist.mean``, which satisfies the constraint exactly.

    The right-hand side, at construction or per call (a call's value wins), is a Python number or a tensor
    (floating or integer) of any shape that broadcasts to ``(*batch, a)``: a number, ``()`` or a last
    dimension of 1 is shared by all ``a`` rows, and batch dimensions broadcast with the features'. The last
    dimension is always the row index: one value per sample for a one-row constraint is ``(*batch, 1)``
    (``k.unsqueeze(-1)``), not ``(*batch,)``. Neither given, or shapes that do not broadcast, is a
    ``ValueError`` naming ``constraint_value`` and the shapes.

    Mixed precision: under ``torch.autocast`` the distribution takes the widest dtype of the layer's output and
    ``constraint_value``; a bfloat16 / float16 distribution is computed in float32 and returned in its dtype.

    Exactly one of ``constraint_matrix`` (dense ``A``, ``(a, out_features)``, stored as a buffer) and ``index``
    (group ids for sum constraints, ``(out_features,)``) is given.

    **Bounds.** With ``lower`` and / or ``upper`` the head returns the Gaussian conditioned on :math:`Az = k`
    *and* truncated to :math:`lower \le z \le upper`, a :class:`~hardeq.TruncatedConstrainedNormal`
    (``dist.truncate(lower, upper)``): ``sample`` draws exactly feasible points (every entry within its bounds,
    every row of :math:`Az = k` to round-off), ``mode`` is the most probable feasible point (the covariance-metric
    projection of the conditional mean onto the plane and the box) and ``log_prob`` is the restricted density
    (docs/bounds.md). A long-only portfolio is ``constraint_value=1.0, lower=0.0, upper=1.0``; non-negative flows
    are ``lower=0.0``. A bound is a number (the same for every output; ``-inf`` / ``inf`` for none) or a tensor
    ``(out_features,)`` / ``(*batch, out_features)`` (per output, per sample); a call's ``lower=`` / ``upper=``
    replace the head's. Training: ``-dist.log_prob(y)``. While the head is in training mode (``head.train()``, the
    default) and grad mode is on, the truncated law is built with ``training=`` the head's own
    :class:`~hardeq.bounds.PersistentChains` (:mod:`hardeq.bounds.training`): ``log_prob`` is then the
    *unnormalised* density whose gradient carries the normaliser's from a few sweeps of chains kept across steps
    (cheap, biased; exact normaliser where ``n - a == 1``); in ``head.eval()`` or under ``torch.no_grad()`` it is the
    normalised density (report an NLL there). ``head(..., training=False)`` forces the normalised density (its
    gradient estimated with the sampler's draws, unbiased, slow), ``training=True`` the head's chains, a
    :class:`~hardeq.bounds.PersistentChains` those chains. The closed-form ``expected_l2`` / ``expected_l1`` belong to
    the untruncated law (``head(features, k, lower=None, upper=None)`` with no bounds at construction, or
    ``dist.base``, see :class:`~hardeq.TruncatedConstrainedNormal`).

    Args:
        in_features (int): size of the features.
        out_features (int): ``n``, the size of the constrained output.
        constraint_matrix (Tensor, optional): ``A``.
        index (LongTensor, optional): group id per output coordinate.
        constraint_value (Tensor or float, optional): a fixed :math:`k` (stored as a buffer), used when a call
            passes none.
        min_scale (float): floor :math:`\sigma_{\min}` added to every scale.
        lower, upper (float or Tensor, optional): bounds of every output (see **Bounds**); ``None`` (default):
            unbounded, and the head returns the :class:`~hardeq.ConstrainedNormal` itself.

    Shapes:
        features: ``(*batch, in_features)``; constraint_value: broadcastable to ``(*batch, a)``;
        returns a distribution with ``batch_shape = broadcast(*batch, constraint_value.shape[:-1])`` and
        ``event_shape = (n,)``; lower / upper: a number, ``(n,)`` or broadcastable to ``(*batch, n)``.

    Cost: one linear layer and the conditioner of the constraint (O(n) for group sums, O(n a^2) dense); with
    bounds ``sample`` adds the sampler's cost (rejection, blocked Gibbs or exact HMC, docs/bounds.md) and ``mode`` a QP.

    Example:
        >>> head = ConstrainedGaussianHead(8, 4, constraint_matrix=torch.ones(1, 4))
        >>> dist = head(torch.randn(16, 8), torch.ones(16, 1))
        >>> dist.batch_shape, bool(torch.allclose(dist.mean.sum(-1), torch.ones(16)))
        (torch.Size([16]), True)
        >>> portfolio = ConstrainedGaussianHead(8, 4, constraint_matrix=torch.ones(1, 4), constraint_value=1.0)
        >>> bool(torch.allclose(portfolio(torch.randn(16, 8)).mean.sum(-1), torch.ones(16)))
        True
        >>> long_only = ConstrainedGaussianHead(8, 4, constraint_matrix=torch.ones(1, 4), constraint_value=1.0,
        ...                                     lower=0.0, upper=1.0)
        >>> w = long_only(torch.randn(16, 8)).sample((3,))
        >>> w.shape, bool((w >= 0).all() and (w <= 1).all()), bool(torch.allclose(w.sum(-1), torch.ones(3, 16)))
        (torch.Size([3, 16, 4]), True, True)
    """

    def __init__(self, in_features: int, out_features: int, *, constraint_matrix: Tensor | None = None,
                 index: Tensor | None = None, constraint_value: Tensor | float | None = None,
                 min_scale: float = 1e-4, lower: Tensor | float | None = None,
                 upper: Tensor | float | None = None) -> None:
        super().__init__()
        self.constraint_matrix: Tensor | None  # buffers (typed here: nn.Module's attribute lookup says Tensor | Module)
        self.index: Tensor | None
        self.constraint_value: Tensor | None
        self.lower: Tensor | None
        self.upper: Tensor | None
        if (constraint_matrix is None) == (index is None):
            raise ValueError("pass exactly one of constraint_matrix (dense A) and index (group sums).")
        if not min_scale > 0:
            raise ValueError(f"min_scale must be positive, got {min_scale}.")
        if constraint_matrix is not None:
            # validates shape, rank, a < n once; k is a dummy here
            LinearConstraint(constraint_matrix, torch.zeros(constraint_matrix.shape[:-1],
                                                            dtype=constraint_matrix.dtype), validate_args=True)
            if constraint_matrix.shape[-1] != out_features:
                raise ValueError(f"constraint_matrix must have {out_features} columns (out_features), got shape "
                                 f"{tuple(constraint_matrix.shape)}.")
            self.register_buffer("constraint_matrix", constraint_matrix.clone())
            self.index = None
        else:
            assert index is not None  # (exactly one of the two was checked above)
            groups = int(index.max()) + 1 if isinstance(index, Tensor) and index.numel() else 0
            SumConstraint(index, torch.zeros(groups))  # validates index
            if index.shape[0] != out_features:
                raise ValueError(f"index must have shape ({out_features},), got {tuple(index.shape)}.")
            self.register_buffer("index", index.clone())
            self.constraint_matrix = None
        self.in_features, self.out_features, self.min_scale = in_features, out_features, min_scale
        if constraint_value is not None:  # checked now against (a,); a number is kept as a 0-dim tensor
            _right_hand_side(constraint_value, self.num_constraints, torch.Size(), torch.float64, None,
                             "at construction")
            constraint_value = (constraint_value.detach().clone() if isinstance(constraint_value, Tensor)
                                else torch.tensor(float(constraint_value)))
        self.register_buffer("constraint_value", constraint_value)
        lower = check_bound(lower, "lower", out_features, "ConstrainedGaussianHead")
        upper = check_bound(upper, "upper", out_features, "ConstrainedGaussianHead")
        check_bounds(lower, upper, "ConstrainedGaussianHead")
        self.register_buffer("lower", lower)
        self.register_buffer("upper", upper)
        self.linear = nn.Linear(in_features, 2 * out_features)

    @property
    def num_constraints(self) -> int:
        if self.constraint_matrix is not None:
            return self.constraint_matrix.shape[-2]
        assert self.index is not None  # (a head has a constraint_matrix or an index)
        # (read once per index contents: a host read, remembered while the buffer's version is unchanged --
        # load_state_dict and every in-place edit bump it)
        key = (id(self.index), self.index._version)
        cached = self.__dict__.get("_num_groups")
        if cached is None or cached[0] != key:
            cached = (key, int(self.index.max()) + 1)
            self.__dict__["_num_groups"] = cached
        return cached[1]

    def constraint(self, constraint_value: Tensor | float | None = None) -> EqualityConstraint:
        """The constraint object for right-hand side ``constraint_value`` (default: the fixed one), broadcast to
        ``(..., a)``."""
        k = self._resolve(constraint_value, torch.Size())
        if self.constraint_matrix is not None:
            return LinearConstraint(self.constraint_matrix.to(k.dtype), k, validate_args=False)
        assert self.index is not None  # (a head has a constraint_matrix or an index)
        return SumConstraint(self.index, k, validate_args=False)

    def _resolve(self, constraint_value: Tensor | float | None, batch: torch.Size,
                 dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
        """``k`` from the call or the buffer, as a tensor ``(..., a)`` that broadcasts with ``batch``."""
        if constraint_value is None:
            constraint_value = self.constraint_value
            if constraint_value is None:
                raise ValueError("constraint_value (the right-hand side k) must be given: pass it per call, "
                                 "head(features, k), or fix it at construction, ConstrainedGaussianHead(..., "
                                 "constraint_value=k).")
        if dtype is None:
            dtype = constraint_value.dtype if isinstance(constraint_value, Tensor) and \
                constraint_value.is_floating_point() else torch.get_default_dtype()
        return _right_hand_side(constraint_value, self.num_constraints, batch, dtype, device, "")

    def forward(self, features: Tensor, constraint_value: Tensor | float | None = None, *,
                lower: Tensor | float | EllipsisType | None = ..., upper: Tensor | float | EllipsisType | None = ...,
                training: bool | PersistentChains | None = None) -> ConstrainedNormal | TruncatedConstrainedNormal:
        """The distribution of the outputs given ``features`` ``(*batch, in_features)`` and the right-hand side
        (default: the fixed one). ``lower`` / ``upper`` replace the head's bounds for this call (``None``: no such
        bound; omitted: the head's). ``training``: the truncated law's training mode (:func:`training_mode`;
        default: persistent chains in ``train()`` with grad on, the normalised density otherwise). Returns a
        :class:`~hardeq.ConstrainedNormal`, or a :class:`~hardeq.TruncatedConstrainedNormal` when a bound is in
        force."""
        lower = self.lower if lower is ... else check_bound(lower, "lower", self.out_features, "forward")
        upper = self.upper if upper is ... else check_bound(upper, "upper", self.out_features, "forward")
        check_bounds(lower, upper, "forward")
        if not isinstance(features, Tensor) or features.dim() < 1 or features.shape[-1] != self.in_features:
            shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            raise ValueError(f"features must have shape (..., {self.in_features}), got {shape}.")
        loc, raw_scale = self.linear(features).chunk(2, dim=-1)
        scale = F.softplus(raw_scale) + self.min_scale
        # under torch.autocast the layer returns bfloat16 / float16: promote to the widest of the three, so a
        # float32 right-hand side gives a float32 distribution (half-precision ones compute in float32 anyway)
        dtype = torch.promote_types(loc.dtype, scale.dtype)
        given = constraint_value if constraint_value is not None else self.constraint_value
        if isinstance(given, Tensor) and given.is_floating_point():
            dtype = torch.promote_types(dtype, given.dtype)
        k = self._resolve(constraint_value, features.shape[:-1], dtype, loc.device)
        dist = ConstrainedNormal(loc.to(dtype), scale.to(dtype), constraint=self.constraint(k))
        return truncate(dist, lower, upper, training_mode(self, training))

    def extra_repr(self) -> str:
        kind = "dense" if self.constraint_matrix is not None else "sum"
        fixed = "" if self.constraint_value is None else f", constraint_value={tuple(self.constraint_value.shape)}"
        for name in ("lower", "upper"):
            b = getattr(self, name)
            if b is not None:
                fixed += f", {name}={float(b):g}" if b.dim() == 0 else f", {name}={tuple(b.shape)}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"a={self.num_constraints}, constraint={kind}{fixed}")


def _right_hand_side(value: object, a: int, batch: torch.Size, dtype: torch.dtype, device: torch.device | None,
                     when: str) -> Tensor:
    """``value`` (a number or a floating / integer tensor) as a tensor ``(..., a)`` in ``dtype`` on ``device``:
    a number, ``()`` or a last dimension of 1 is repeated over the ``a`` rows; its batch dimensions must
    broadcast with ``batch``. ``TypeError`` / ``ValueError`` naming ``constraint_value`` and the shapes."""
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return torch.full((a,), float(cast(SupportsFloat, value)), dtype=dtype, device=device)  # (complex: TypeError)
    if not isinstance(value, Tensor) or value.dtype == torch.bool or value.is_complex():
        what = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"constraint_value must be a Python number or a floating / integer torch.Tensor, got {what}.")
    if device is not None and value.device != device:
        raise ValueError(f"constraint_value is on device {value.device} but the features are on {device}.")
    shape = tuple(value.shape)
    if value.dim() == 0 or value.shape[-1] == 1:
        value = value.expand(value.shape[:-1] + (a,))
    try:
        ok = value.shape[-1] == a and bool(torch.broadcast_shapes(value.shape[:-1], batch) is not None)
    except RuntimeError:
        ok = False
    if not ok:
        hint = (" (for one value per sample of a one-row constraint pass shape (*batch, 1), e.g. k.unsqueeze(-1))"
                if a == 1 else "")
        at = f" {when}" if when else ""
        raise ValueError(f"constraint_value must have shape (..., {a}), got {shape}{at}: it must broadcast to "
                         f"(*batch, a) with the features' batch shape {tuple(batch)} and a = {a} rows (a number, () "
                         f"or a last dimension of 1 is shared by the rows){hint}.")
    return value.to(dtype)
