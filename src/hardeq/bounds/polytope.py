r"""The polytope :math:`\{Az = k\} \cap [l, u]`: the bounds as tensors, and when the truncated law exists.

The law of :math:`z \sim \mathcal N(\mu, \Sigma)` given :math:`Az = k` and :math:`l \le z \le u` exists when the
box meets the plane in a set of positive ``(n - a)``-dimensional volume, :math:`P(\text{box}\mid\text{plane}) > 0`.
:func:`check_polytope` raises a ``ValueError`` otherwise, with what it can certify without a linear program:

* a bound pair with ``lower > upper`` or ``lower == upper`` (no volume), or ``NaN``;
* **per row** (every constraint type): :math:`(Az)_i` ranges over
  :math:`[\sum_j \min(a_{ij}l_j, a_{ij}u_j),\ \sum_j \max(a_{ij}l_j, a_{ij}u_j)]` on the box, so a :math:`k_i`
  outside that interval is infeasible (for a grouped sum: :math:`\sum_{j\in c} l_j \le k_c \le \sum_{j \in c} u_j`,
  exact), and a :math:`k_i` at one of its ends forces every coordinate of the row to a bound (a face: the polytope
  has no volume on the plane; a single point when every row is so);
* for one free dimension (``n - a == 1``) the plane is a line and the box an interval of it, which is tested
  exactly (:func:`hardeq.bounds.normaliser.line_interval`).

For a general ``A``, an empty polytope that no single row certifies is found by the mode solver
(:func:`hardeq.bounds.mode.truncated_mode` raises :class:`~hardeq.bounds.mode.ModeNotFound`, naming the row it
could not meet); a polytope that is flat only through a combination of rows is not detected here (the samplers
then see an acceptance of zero).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..constraints import EqualityConstraint

__all__ = ["as_bound", "check_box_and_polytope", "check_bounds", "check_polytope", "row_ranges"]


def as_bound(name: str, value: object, shape: torch.Size, dtype: torch.dtype, device: torch.device,
             default: float) -> Tensor:
    """``value`` (``None``, a real number, or a tensor broadcastable to ``shape`` = batch + (n,)) as a tensor
    broadcast to ``shape`` in ``dtype``; ``None`` gives ``default`` (``±inf``). ``TypeError`` / ``ValueError`` naming
    ``name``, with the expected and received."""
    if value is None:
        return torch.full((), default, dtype=dtype, device=device).expand(shape)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.full((), float(value), dtype=dtype, device=device).expand(shape)
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be None, a real number or a torch.Tensor broadcastable to batch_shape + (n,) = "
                        f"{tuple(shape)}, got {type(value).__name__}.")
    if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64, torch.int16, torch.int8,
                                                         torch.uint8)):
        raise TypeError(f"{name} must be a real tensor, got dtype {value.dtype}.")
    if value.device != device:
        raise ValueError(f"{name} is on device {value.device} but loc is on {device}; pass {name} on {device}.")
    try:
        out = torch.broadcast_to(value.to(dtype), shape)
    except RuntimeError:
        raise ValueError(f"{name} must broadcast to batch_shape + (n,) = {tuple(shape)}, got shape "
                         f"{tuple(value.shape)}.") from None
    if value.is_floating_point() and value.dtype != dtype:
        if not bool((out.to(value.dtype) == value).all()):
            raise ValueError(f"{name} ({value.dtype}) is not representable in the distribution's dtype {dtype}; "
                             f"pass it as {dtype} so that the box is the one you meant.")
    return out


def _box_faults(lower: Tensor, upper: Tensor) -> Tensor:
    """``(4,)`` bool, no host read: NaN in ``lower``, NaN in ``upper``, a bound at the wrong infinity, ``lower >=
    upper`` somewhere (what :func:`check_bounds` refuses)."""
    return torch.stack([torch.isnan(lower).any(), torch.isnan(upper).any(),
                        (lower == float("inf")).any() | (upper == -float("inf")).any(), (lower >= upper).any()])


def check_bounds(lower: Tensor, upper: Tensor) -> None:
    """``ValueError`` for ``NaN`` bounds, ``lower > upper``, ``lower == upper`` (a box of no volume), or a bound at
    the wrong infinity (``lower = +inf`` / ``upper = -inf``); names the first offending index.

    Examples:
        >>> from hardeq.bounds import check_bounds
        >>> check_bounds(torch.zeros(2), torch.tensor([1.0, float("inf")]))  # a valid box: returns None
        >>> check_bounds(torch.zeros(2), torch.tensor([1.0, -1.0]))
        Traceback (most recent call last):
            ...
        ValueError: the box must have lower < upper in every coordinate; at index (1,) ... lower > upper.
    """
    bad = lower >= upper
    if not any(_box_faults(lower, upper).tolist()):               # one host read for a valid box
        return
    for name, t in (("lower", lower), ("upper", upper)):
        if bool(torch.isnan(t).any()):
            idx = tuple(int(i) for i in torch.isnan(t).nonzero()[0])
            raise ValueError(f"{name} must not hold NaN, got NaN at index {idx}.")
    if bool((lower == float("inf")).any()) or bool((upper == -float("inf")).any()):
        raise ValueError("lower must be < +inf and upper > -inf (use -inf / +inf, or None, for an unbounded side).")
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        lo, hi = float(lower[idx]), float(upper[idx])
        what = ("lower == upper pins the coordinate: the box has no volume on the plane, so the truncated law "
                "has no density (fix the coordinate in the constraint instead)" if lo == hi else "lower > upper")
        raise ValueError(f"the box must have lower < upper in every coordinate; at index {idx} (batch..., coordinate) "
                         f"got lower = {lo:.6g}, upper = {hi:.6g}: {what}.")


def row_ranges(constraint: EqualityConstraint, lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""The range of each :math:`(Az)_i` over the box: ``(low, high, size)``, each ``(*batch, a)`` float64, with
    ``size`` :math:`= \sum_j |a_{ij}|\max(|l_j|, |u_j|)` over the finite bounds (the scale of the row's terms, for
    tolerances). A zero coefficient contributes nothing, whatever the bound. Cost O(n) grouped, O(a n) otherwise.

    Examples:
        >>> from hardeq.bounds import row_ranges
        >>> A = LinearConstraint(torch.tensor([[1.0, -2.0, 0.0]]), torch.zeros(1))  # z_1 - 2 z_2 over [0, 1]^2
        >>> low, high, size = row_ranges(A, torch.zeros(3), torch.tensor([1.0, 1.0, 5.0]))
        >>> low, high, size
        (tensor([-2.], dtype=torch.float64), tensor([1.], dtype=torch.float64), tensor([3.], dtype=torch.float64))
    """
    f64 = torch.float64
    lo, hi = lower.to(f64), upper.to(f64)
    mag = torch.where(torch.isfinite(lo), lo.abs(), 0.0).maximum(torch.where(torch.isfinite(hi), hi.abs(), 0.0))
    if constraint.group_index is not None:
        index, a = constraint.group_index, constraint.num_constraints

        def gsum(x: Tensor) -> Tensor:
            return torch.zeros(x.shape[:-1] + (a,), dtype=f64, device=x.device).index_add_(-1, index, x)

        return gsum(lo), gsum(hi), gsum(mag)
    A = constraint.dense_matrix().detach().to(f64)
    lo_, hi_, mag_ = lo.unsqueeze(-2), hi.unsqueeze(-2), mag.unsqueeze(-2)
    zero = torch.zeros((), dtype=f64, device=A.device)
    pos, neg = A > 0, A < 0
    low = torch.where(pos, A * lo_, torch.where(neg, A * hi_, zero)).sum(-1)
    high = torch.where(pos, A * hi_, torch.where(neg, A * lo_, zero)).sum(-1)
    size = (A.abs() * mag_).sum(-1)
    return low, high, size


def _row_faults(constraint: EqualityConstraint, lower: Tensor, upper: Tensor,
                rtol: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(low, high, size, k, slack, out, face)``, ``(*batch, a)`` each, no host read: each row's range over the box,
    its scale, ``k``, the tolerance, and where ``k`` lies outside the range (empty) or at an end of it (a face)."""
    low, high, size = row_ranges(constraint, lower, upper)
    k = constraint.k.detach().to(torch.float64)
    shape = torch.broadcast_shapes(low.shape, k.shape)
    low, high, size, k = (t.expand(shape) for t in (low, high, size, k))
    slack = rtol * (size + k.abs())
    out = (k < low - slack) | (k > high + slack)
    face = ((k - low).abs() <= slack) | ((high - k).abs() <= slack)
    return low, high, size, k, slack, out, face


def check_box_and_polytope(constraint: EqualityConstraint, lower: Tensor, upper: Tensor, rtol: float) -> None:
    """:func:`check_bounds` then :func:`check_polytope` (the same errors, in that order) in one host read where
    both pass: what making a truncated law checks, once per law (a training step makes one per step)."""
    faults = torch.cat([_box_faults(lower, upper), torch.stack([t.any() for t in
                                                                _row_faults(constraint, lower, upper, rtol)[5:]])])
    if not any(faults.tolist()):
        return
    check_bounds(lower, upper)
    check_polytope(constraint, lower, upper, rtol)


def check_polytope(constraint: EqualityConstraint, lower: Tensor, upper: Tensor, rtol: float) -> None:
    r"""``ValueError`` unless every row of :math:`Az = k` can be met strictly inside the box (module docstring):
    names the batch element and the row (the group, for a grouped sum), the interval it must lie in, and ``k``.
    ``rtol``: the untruncated distribution's per-row tolerance (1e-5 float32, 1e-12 float64); a ``k`` within it of an
    end of the interval is a face (no volume).

    Examples:
        >>> from hardeq.bounds import check_polytope
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> lower = torch.zeros(3, dtype=torch.float64)
        >>> check_polytope(total, lower, torch.full((3,), 2.0, dtype=torch.float64), 1e-12)  # feasible: None
        >>> check_polytope(total, lower, torch.full((3,), 0.5, dtype=torch.float64), 1e-12)
        Traceback (most recent call last):
            ...
        ValueError: the polytope {A z = k} ∩ [lower, upper] is empty: group 0 ... sum to [0, 1.5], but k = 3. ...
    """
    low, high, size, k, slack, out, face = _row_faults(constraint, lower, upper, rtol)
    if not any(torch.stack([out.any(), face.any()]).tolist()):  # one host read for a polytope with volume
        return
    grouped = constraint.group_index is not None
    kind = "group" if grouped else "row"
    if bool(out.any()):
        idx = tuple(int(i) for i in out.nonzero()[0])
        b, i = idx[:-1], idx[-1]
        what = (f"its {int(cast(Tensor, constraint.group_sizes)[i])} members in their bounds sum to" if grouped else
                "(A z) over the box ranges over")
        raise ValueError(f"the polytope {{A z = k}} ∩ [lower, upper] is empty: {kind} {i} of batch element {b} cannot "
                         f"be met; {what} [{float(low[idx]):.6g}, {float(high[idx]):.6g}], but k = "
                         f"{float(k[idx]):.6g}. Widen the bounds or change k.")
    if bool(face.any()):
        idx = tuple(int(i) for i in face.nonzero()[0])
        b, i = idx[:-1], idx[-1]
        end = "lower" if bool((k[idx] - low[idx]).abs() <= slack[idx]) else "upper"
        raise ValueError(f"the polytope {{A z = k}} ∩ [lower, upper] has no volume on the plane: {kind} {i} of batch "
                         f"element {b} has k = {float(k[idx]):.6g} at the {end} end of its range "
                         f"[{float(low[idx]):.6g}, {float(high[idx]):.6g}], which forces every coordinate of the "
                         f"{kind} to a bound (a face; a single point when every {kind} is so). P(box | plane) = 0 and "
                         "the truncated law has no density; nothing random is left there. Fix those coordinates "
                         "(drop them from the model) or widen the bounds.")
