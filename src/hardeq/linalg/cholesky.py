"""Cholesky factorisation that fails loudly and precisely."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import NotPSDError

__all__ = ["psd_cholesky"]


def psd_cholesky(matrix: Tensor, *, name: str = "A Sigma A^T") -> Tensor:
    r"""Lower Cholesky factor of a symmetric positive definite ``matrix``.

    No jitter is added: a perturbed factor would make conditioned samples violate ``A z = k``.

    Shapes:
        matrix: ``(*batch, a, a)``; returns ``(*batch, a, a)``.

    Raises:
        NotPSDError: if any batch element is not numerically positive definite (or holds NaN/inf); the
            message names the first failing batch index, the failing pivot and the extreme diagonal entries.
    """
    if not bool(torch.isfinite(matrix).all()):
        raise NotPSDError(f"{name} has NaN/inf entries (shape {tuple(matrix.shape)}); check the inputs.")
    factor, info = torch.linalg.cholesky_ex(matrix)
    if bool((info > 0).any()):
        flat = info.reshape(-1)
        first = int(torch.nonzero(flat > 0)[0, 0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), info.shape)) if info.dim() else ()
        diag = matrix.diagonal(dim1=-2, dim2=-1)
        raise NotPSDError(
            f"{name} is not numerically positive definite (batch index {index}, pivot {int(flat[first])} of "
            f"{matrix.shape[-1]}, dtype {matrix.dtype}, diagonal range [{diag.min().item():.3e}, "
            f"{diag.max().item():.3e}]). The constraint rows are (nearly) linearly dependent under this "
            "covariance; remove redundant rows, rescale them, or use float64."
        )
    return factor
