r"""A bijection from :math:`\mathbb R^{n-a}` onto the plane :math:`\{z : Az = k\}`, registered for the support of
:class:`~hardeq.ConstrainedNormal` with ``torch.distributions``' ``biject_to`` and ``transform_to``.

.. math::
    z = T(y) = z_0 + Ny, \qquad y = T^{-1}(z) = N^\top(z - z_0),

with :math:`z_0 = A^\top(AA^\top)^{-1}k` the minimum-norm point of the plane and ``N`` (``n x (n - a)``) an
orthonormal basis of :math:`\mathrm{null}(A)`. ``N`` has orthonormal columns, so ``T`` is an isometry of
:math:`\mathbb R^{n-a}` onto the plane and :math:`\log|\det J| = 0`: a density of ``y`` with respect to Lebesgue
measure on :math:`\mathbb R^{n-a}` is the density of ``z`` with respect to Lebesgue (Hausdorff) measure *on the
plane*, the measure :meth:`~hardeq.ConstrainedNormal.log_prob` is a density for. (The inverse applied off the plane
is the orthogonal projection onto it, followed by ``T^{-1}``.)

This is what Pyro's autoguides (``AutoNormal``, ``AutoDelta``, ``AutoMultivariateNormal``, ...) and
``pyro.param(..., constraint=d.support)`` look up: they learn ``y`` unconstrained and map it onto the plane. It
works without Pyro (``torch.distributions.biject_to(d.support)``).

``N`` is never formed (it would be ``n x (n - a)``):

* a grouped sum (a :class:`~hardeq.SumConstraint`: :attr:`~hardeq.EqualityConstraint.group_index` set) uses,
  per group ``g`` of size ``m``, the Householder reflection :math:`H_g = I - 2vv^\top / v^\top v`,
  :math:`v = e_1 - \mathbf 1/\sqrt m`, which maps :math:`e_1` to :math:`\mathbf 1/\sqrt m`; its other ``m - 1``
  columns are an orthonormal basis of :math:`\{x : \sum x = 0\}`. ``y`` fills the group's slots after its first;
  applying all :math:`H_g` is one scatter and one gather, O(n) per vector (a group of one has no free coordinate:
  it gets its total);
* any other constraint uses the Householder QR of :math:`A^\top` (``torch.geqrf``, float64, O(a^2 n) once): ``N``
  is the last ``n - a`` columns of ``Q``, applied with ``torch.ormqr`` in O(n a) per vector.

The result is passed through :meth:`~hardeq.EqualityConstraint.project` (the identity on the plane up to
round-off), so every row meets the per-row criterion of the constraint's dtype. Batched: ``k`` (and ``A``) may
carry batch dimensions, ``y`` has shape ``(*sample, *batch, n - a)``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import constraints
from torch.distributions.transforms import Transform

from ..constraints import EqualityConstraint
from .normal import _AffineSubspace
from .truncated_support import _BoxOnPlane

__all__ = ["PlaneTransform"]


class _GroupedBasis:
    """The per-group Householder basis of a grouped-sum constraint (:attr:`~hardeq.EqualityConstraint.group_index`
    not ``None``: a :class:`~hardeq.SumConstraint`; see the module docstring); O(n) memory."""

    def __init__(self, constraint: EqualityConstraint, index: Tensor) -> None:
        n, a = constraint.event_size, constraint.num_constraints
        dtype = constraint.k.dtype
        position = torch.arange(n, device=index.device)
        first = torch.full((a,), n, dtype=torch.long, device=index.device).scatter_reduce(0, index, position, "amin")
        is_first = position == first[index]
        # the n - a free slots (not a group's first), in order; a stable sort needs no host read
        self.free = torch.argsort(is_first.to(torch.int8), stable=True)[: n - a]
        sizes = constraint.group_sizes
        assert sizes is not None  # (a grouped constraint has group sizes)
        counts = sizes.to(device=index.device, dtype=dtype)
        s = counts.rsqrt()
        self.v = is_first.to(dtype) - s[index]  # (n,)
        vtv = 2.0 - 2.0 * s  # (a,): 0 for a group of one (its reflection is the identity)
        self.two_over_vtv = torch.where(vtv > 0, 2.0 / vtv.clamp_min(torch.finfo(dtype).tiny), torch.zeros_like(vtv))
        self.index, self.n, self.a = index, n, a

    def reflect(self, x: Tensor) -> Tensor:
        """:math:`Hx` (``H`` symmetric and orthogonal: its own inverse), ``(..., n)``."""
        v = self.v.to(x.dtype)
        w = torch.zeros(x.shape[:-1] + (self.a,), dtype=x.dtype, device=x.device).index_add(-1, self.index, v * x)
        return x - v * (w * self.two_over_vtv.to(x.dtype))[..., self.index]

    def apply(self, y: Tensor) -> Tensor:
        x = torch.zeros(y.shape[:-1] + (self.n,), dtype=y.dtype, device=y.device)
        return self.reflect(x.index_copy(-1, self.free, y))

    def apply_t(self, x: Tensor) -> Tensor:
        return self.reflect(x).index_select(-1, self.free)


class _HouseholderBasis:
    """``N`` as the last ``n - a`` columns of the ``Q`` of a Householder QR of :math:`A^\\top` (float64)."""

    def __init__(self, constraint: EqualityConstraint) -> None:
        A = constraint.dense_matrix().to(torch.float64)  # (*batch_A, a, n)
        self.packed, self.tau = torch.geqrf(A.mT)  # (*batch_A, n, a), (*batch_A, a)
        self.batch = A.shape[:-2]
        self.n, self.a = A.shape[-1], A.shape[-2]

    def _q(self, x: Tensor, transpose: bool) -> Tensor:
        """:math:`Qx` or :math:`Q^\\top x` for ``x`` of shape ``(..., n)`` (float64)."""
        nb = len(self.batch)
        shape = torch.broadcast_shapes(x.shape[:-1], self.batch)
        x = x.expand(shape + (self.n,))
        lead = shape[: len(shape) - nb]
        cols = x.reshape((-1,) + self.batch + (self.n,)).movedim(0, -1)  # (*batch_A, n, P)
        out = torch.ormqr(self.packed, self.tau, cols, left=True, transpose=transpose)
        return out.movedim(-1, 0).reshape(lead + self.batch + (self.n,))

    def apply(self, y: Tensor) -> Tensor:
        x = torch.cat([torch.zeros(y.shape[:-1] + (self.a,), dtype=torch.float64, device=y.device),
                       y.to(torch.float64)], dim=-1)
        return self._q(x, transpose=False).to(y.dtype)

    def apply_t(self, x: Tensor) -> Tensor:
        return self._q(x.to(torch.float64), transpose=True)[..., self.a:].to(x.dtype)


class PlaneTransform(Transform):
    r"""The isometry :math:`y \mapsto z_0 + Ny` of :math:`\mathbb R^{n-a}` onto :math:`\{z : Az = k\}` (module
    docstring). ``domain``: real vectors of size ``n - a``; ``codomain``: the support of a
    :class:`~hardeq.ConstrainedNormal` on ``constraint``; ``log_abs_det_jacobian`` is 0 (densities on the plane
    with respect to its Lebesgue measure).

    Args:
        constraint: the plane.

    Cost: O(n) per vector for a :class:`~hardeq.SumConstraint`, O(n a) otherwise (plus an O(a^2 n) QR once).

    Examples:
        >>> import torch, hardeq
        >>> from torch.distributions import biject_to
        >>> c = hardeq.SumConstraint(torch.tensor([0, 0, 0, 1, 1]), torch.tensor([3.0, -1.0]))
        >>> t = biject_to(hardeq.ConstrainedNormal(torch.zeros(5), 1.0, constraint=c).support)
        >>> z = t(torch.tensor([0.5, -2.0, 1.0]))  # 5 - 2 free coordinates
        >>> bool(c.check(z)), torch.allclose(t.inv(z), torch.tensor([0.5, -2.0, 1.0]))
        (True, True)
    """

    domain = constraints.real_vector
    bijective = True
    sign = 1

    def __init__(self, constraint: EqualityConstraint, cache_size: int = 0) -> None:
        super().__init__(cache_size=cache_size)
        self.constraint = constraint
        self.n, self.a = constraint.event_size, constraint.num_constraints
        index = constraint.group_index  # grouped sums (a SumConstraint) have an O(n) basis
        self._basis = _HouseholderBasis(constraint) if index is None else _GroupedBasis(constraint, index)
        self._z0 = constraint.particular_solution()  # (*batch, n)

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def codomain(self) -> constraints.Constraint:
        return _AffineSubspace(self.constraint)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlaneTransform) and other.constraint is self.constraint

    def __hash__(self) -> int:
        return id(self.constraint)

    def with_cache(self, cache_size: int = 1) -> "PlaneTransform":
        return self if self._cache_size == cache_size else PlaneTransform(self.constraint, cache_size)

    def _call(self, y: Tensor) -> Tensor:
        if y.shape[-1:] != (self.n - self.a,):
            raise ValueError(f"PlaneTransform: the unconstrained vector must have n - a = {self.n - self.a} entries "
                             f"(last dimension), got shape {tuple(y.shape)}.")
        z = self._z0.to(y.dtype) + self._basis.apply(y)
        return self.constraint.project(z)

    def _inverse(self, z: Tensor) -> Tensor:
        if z.shape[-1:] != (self.n,):
            raise ValueError(f"PlaneTransform: a point of the plane must have n = {self.n} entries (last dimension), "
                             f"got shape {tuple(z.shape)}.")
        return self._basis.apply_t(z - self._z0.to(z.dtype))

    def log_abs_det_jacobian(self, x: Tensor, y: Tensor) -> Tensor:
        """0: ``N`` has orthonormal columns (densities on the plane w.r.t. its Lebesgue measure). Shape: the batch
        of ``x``, ``x.shape[:-1]``."""
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)

    def forward_shape(self, shape: torch.Size | tuple[int, ...]) -> torch.Size:
        if len(shape) < 1 or shape[-1] != self.n - self.a:
            raise ValueError(f"PlaneTransform maps vectors of size n - a = {self.n - self.a}, got shape "
                             f"{tuple(shape)}.")
        return torch.Size(shape[:-1]) + (self.n,)

    def inverse_shape(self, shape: torch.Size | tuple[int, ...]) -> torch.Size:
        if len(shape) < 1 or shape[-1] != self.n:
            raise ValueError(f"PlaneTransform maps back vectors of size n = {self.n}, got shape {tuple(shape)}.")
        return torch.Size(shape[:-1]) + (self.n - self.a,)

    def __repr__(self) -> str:
        return f"PlaneTransform(n={self.n}, a={self.a})"


def _plane_transform(support: _AffineSubspace) -> Transform:
    return PlaneTransform(support.constraint)


def _no_box_transform(support: _BoxOnPlane) -> Transform:
    """A box on the plane has no bijection registered (a polytope, not an affine space): say what works instead
    of torch's "Cannot transform _BoxOnPlane constraints"."""
    raise NotImplementedError(
        "hardeq: there is no bijection from R^(n-a) onto a box on the plane {A z = k} (the support of a "
        "TruncatedConstrainedNormal), so Pyro's autoguides (AutoNormal, AutoDelta, AutoMultivariateNormal, ...) and "
        "pyro.param(..., constraint=support) cannot place this latent. Write the guide by hand: sample the site from "
        "a hardeq.contrib.pyro.TruncatedConstrainedNormal (or a ConstrainedNormal(...).truncate(lower, upper)) whose "
        "loc and scale are pyro.param's, or give the model an untruncated ConstrainedNormal latent, which the "
        "autoguides support.")


for _registry in (torch.distributions.biject_to, torch.distributions.transform_to):
    _registry.register(_AffineSubspace, _plane_transform)
    _registry.register(_BoxOnPlane, _no_box_transform)
