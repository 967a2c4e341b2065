r"""The covariance of :class:`~hardeq.ConstrainedNormal` from its constructor's arguments: ``covariance=`` or one
of the keyword shortcuts (``scale``, ``scale_tril``, ``covariance_matrix``, ``precision_matrix``, ``cov_factor``
with ``scale``), shape-checked, with the dtype and device of every argument checked against ``loc``."""

from __future__ import annotations

import numbers
from typing import Callable

import torch
from torch import Tensor

from .._utils import check_finite, check_same_dtype_device, check_tensor
from .._validation import not_a_tensor
from ..constraints import EqualityConstraint
from ..linalg.conditioning import is_tracing
from ..linalg.covariance import Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance
from .normal_precision import HALF_DTYPES


def _covariance_from_arguments(loc: Tensor, scale: Tensor | float | None, covariance: Covariance | None,
                               scale_tril: Tensor | None, cov_factor: Tensor | None,
                               covariance_matrix: Tensor | None, precision_matrix: Tensor | None,
                               constraint: EqualityConstraint, validate: bool,
                               pending: list[tuple[Tensor, Callable[[], None]]]) -> Covariance:
    """The covariance object of :class:`~hardeq.ConstrainedNormal`'s arguments (a real number ``scale`` takes
    ``loc``'s dtype and device), every tensor given checked for ``loc``'s dtype and device and the constraint's;
    with ``validate``, the value checks of a ``covariance_matrix`` / ``precision_matrix`` appended to ``pending``."""
    n = loc.shape[-1]
    if isinstance(scale, Tensor):
        pass
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):  # as torch.distributions.Normal
        scale = torch.tensor(float(scale), dtype=loc.dtype, device=loc.device)
    elif scale is not None and not isinstance(scale, torch.Tensor):
        raise not_a_tensor("scale", scale, note=" (a real Python number is also accepted, as in "
                           "torch.distributions.Normal)")
    covariance = _build_covariance(n, scale, covariance, scale_tril, cov_factor, covariance_matrix,
                                   precision_matrix, validate, pending)
    if scale is not None and cov_factor is None and scale_tril is None and covariance_matrix is None \
            and precision_matrix is None:  # (the common form)
        check_same_dtype_device(loc=loc, scale=scale, constraint=constraint.k)
    else:
        given = {"scale": scale, "scale_tril": scale_tril, "cov_factor": cov_factor,
                 "covariance_matrix": covariance_matrix, "precision_matrix": precision_matrix}
        given = {name: t for name, t in given.items() if t is not None} or {"covariance": covariance.tensors()[0]}
        check_same_dtype_device(loc=loc, **given, constraint=constraint.k)
    return covariance


def _build_covariance(n: int, scale: Tensor | None, covariance: Covariance | None, scale_tril: Tensor | None,
                      cov_factor: Tensor | None, covariance_matrix: Tensor | None = None,
                      precision_matrix: Tensor | None = None, validate: bool = False,
                      pending: list[tuple[Tensor, Callable[[], None]]] | None = None) -> Covariance:
    """The covariance object from ``covariance=`` or the keyword shortcuts (exactly one form), shape-checked."""
    if scale is not None and covariance is None and scale_tril is None and covariance_matrix is None \
            and precision_matrix is None:
        return _scale_covariance(n, scale, cov_factor)  # (the common form, with nothing to reject)
    forms = {"scale": scale, "scale_tril": scale_tril, "covariance_matrix": covariance_matrix,
             "precision_matrix": precision_matrix}
    given = [name for name, t in forms.items() if t is not None]
    if covariance is None and len(given) > 1:
        raise ValueError(f"pass exactly one of scale (alone or with cov_factor), scale_tril, covariance_matrix, "
                         f"precision_matrix and covariance, got {' and '.join(given)}.")
    if covariance is not None and (covariance_matrix is not None or precision_matrix is not None):
        raise ValueError("pass covariance= alone, or one of the shortcuts, not both; got covariance and "
                         f"{'covariance_matrix' if covariance_matrix is not None else 'precision_matrix'}.")
    if covariance is None and cov_factor is not None and scale is None:
        raise ValueError("cov_factor needs scale too (Sigma = W W^T + diag(scale^2)); got cov_factor without scale"
                         + (f" (with {given[0]})." if given else "."))
    if covariance is not None:
        if scale is not None or scale_tril is not None or cov_factor is not None:
            raise ValueError("pass covariance= alone, or one of the shortcuts (scale, scale_tril, cov_factor with "
                             "scale), not both.")
        if not isinstance(covariance, Covariance):
            raise TypeError("covariance must be a hardeq.Covariance (e.g. hardeq.DiagonalCovariance, "
                            "hardeq.BlockDiagonalCovariance or a subclass of your own), got "
                            f"{type(covariance).__name__}.")
    elif scale_tril is not None:
        if scale is not None or cov_factor is not None:
            raise ValueError("pass either scale_tril alone, scale alone, or cov_factor with scale.")
        check_tensor("scale_tril", scale_tril, min_dim=2)
        if scale_tril.shape[-2:] != (n, n):
            raise ValueError(f"scale_tril must have shape (..., n, n) with n = loc.shape[-1] = {n}, got "
                             f"{tuple(scale_tril.shape)}.")
        covariance = FullCovariance(scale_tril)
    elif covariance_matrix is not None or precision_matrix is not None:
        covariance = FullCovariance(_scale_tril_from(n, covariance_matrix, precision_matrix, validate, pending))
    else:
        raise ValueError("one of scale, scale_tril / covariance_matrix / precision_matrix, or covariance must be "
                         "given (cov_factor needs scale too).")
    if covariance.event_size != n:
        raise ValueError(f"covariance has event size {covariance.event_size}, but loc has size n = {n}.")
    return covariance


def _scale_covariance(n: int, scale: Tensor, cov_factor: Tensor | None) -> Covariance:
    """The covariance of ``scale`` (diagonal) or of ``cov_factor`` with ``scale`` (low rank plus diagonal),
    shape-checked."""
    check_tensor("scale", scale)
    if scale.dim() == 0 or scale.shape[-1] == 1:  # broadcast along the event, as torch.distributions.Normal
        scale = scale.expand(scale.shape[:-1] + (n,))
    if scale.shape[-1] != n:
        raise ValueError(f"scale must have shape (..., n) with n = loc.shape[-1] = {n}, got {tuple(scale.shape)}; "
                         "a number, or a tensor whose last dimension is 1, broadcasts along it.")
    if cov_factor is None:
        return DiagonalCovariance(scale)
    check_tensor("cov_factor", cov_factor, min_dim=2)
    if cov_factor.shape[-2] != n:
        raise ValueError(f"cov_factor must have shape (..., n, r) with n = loc.shape[-1] = {n}, got "
                         f"{tuple(cov_factor.shape)}.")
    return LowRankCovariance(cov_factor, scale)


def _scale_tril_from(n: int, covariance_matrix: Tensor | None, precision_matrix: Tensor | None,
                     validate: bool, pending: list[tuple[Tensor, Callable[[], None]]] | None = None) -> Tensor:
    r"""Lower Cholesky factor :math:`L` (:math:`LL^\top = \Sigma`) of ``covariance_matrix``, or of the inverse of
    ``precision_matrix`` without forming it: :math:`JPJ = L_fL_f^\top` gives :math:`P = UU^\top`,
    :math:`U = JL_fJ` upper, so :math:`L = U^{-\top}` (one Cholesky and one triangular solve, :math:`2n^3/3`
    flops). ``ValueError`` naming the argument for a wrong shape, an asymmetric matrix (with ``validate``) or one
    that is not positive definite. With ``validate`` and ``pending``, the value checks are not read here: their
    verdict and the function that raises the precise error are appended to ``pending`` (read with the
    distribution's other checks, :func:`~.normal_checks._check_values`)."""
    name, M = ("covariance_matrix", covariance_matrix) if covariance_matrix is not None else \
        ("precision_matrix", precision_matrix)
    M = check_tensor(name, M, min_dim=2)
    if M.shape[-2:] != (n, n):
        raise ValueError(f"{name} must have shape (..., n, n) with n = loc.shape[-1] = {n}, got {tuple(M.shape)}.")
    original = M
    if M.dtype in HALF_DTYPES:  # factorised in float32, the precision half-precision distributions compute in
        M = M.to(torch.float32)
    flipped = M if name == "covariance_matrix" else M.flip(-2, -1)
    factor: Tensor
    factor, info = torch.linalg.cholesky_ex(flipped)

    def explain() -> None:  # the precise checks, each raising a ValueError that names what it found
        if validate:
            check_finite(name, original)
            if not bool(torch.isclose(original, original.mT, rtol=1e-5, atol=1e-8).all()):
                raise ValueError(f"{name} (shape {tuple(original.shape)}) must be symmetric; its largest asymmetry "
                                 f"|M - M^T| is {(original - original.mT).abs().max().item():.3g}.")
        if bool((info != 0).any()):
            where = tuple(int(i) for i in (info != 0).nonzero()[0]) if info.dim() else ()
            order = int(info[where])
            raise ValueError(f"{name} must be positive definite, but its Cholesky factorisation fails"
                             f"{f' at batch index {where}' if where else ''} (leading minor of order {order}"
                             f"{' of the reversed matrix' if name == 'precision_matrix' else ''} is not positive).")

    if is_tracing():
        if validate:
            check_finite(name, M)
    elif validate and pending is not None:  # finite, symmetric, factorised: read with the distribution's checks
        data = original.detach()
        pending.append(((data.sum() * 0 == 0) & torch.isclose(data, data.mT, rtol=1e-5, atol=1e-8).all()
                        & (info == 0).all(), explain))
    else:
        explain()
    if name == "covariance_matrix":
        return factor
    lower_t = factor.flip(-2, -1).mT  # U^T, lower triangular
    eye = torch.eye(n, dtype=M.dtype, device=M.device)
    inverse: Tensor = torch.linalg.solve_triangular(lower_t, eye, upper=False)  # (U^T)^{-1} = U^{-T}
    return inverse
