r"""Regression heads that return a :class:`~hardeq.ConstrainedNormal`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..constraints import EqualityConstraint, LinearConstraint, SumConstraint
from ..distributions.normal import ConstrainedNormal

__all__ = ["ConstrainedGaussianHead"]


class ConstrainedGaussianHead(nn.Module):
    r"""Features :math:`h` to :math:`\mathcal N(\mu(h), \mathrm{diag}\,\sigma(h)^2)` conditioned on :math:`Az = k`.

    A linear layer predicts a mean and a pre-activation of the scale for each of ``out_features`` outputs,
    :math:`\sigma = \mathrm{softplus}(\cdot) + \sigma_{\min}`; the Gaussian is conditioned on the constraint
    with the right-hand side given per call (e.g. ``k = b - B x`` from the inputs). Train with
    ``dist.expected_l2(y)`` / ``dist.expected_l1(y)`` (closed forms) or ``-dist.log_prob(y)``; predict with
    ``dist.mean``, which satisfies the constraint exactly.

    Mixed precision: under ``torch.autocast`` the distribution takes the widest dtype of the layer's output and
    ``constraint_value``; a bfloat16 / float16 distribution is computed in float32 and returned in its dtype.

    Exactly one of ``constraint_matrix`` (dense ``A``, ``(a, out_features)``, stored as a buffer) and ``index``
    (group ids for sum constraints, ``(out_features,)``) is given.

    Args:
        in_features (int): size of the features.
        out_features (int): ``n``, the size of the constrained output.
        constraint_matrix (Tensor, optional): ``A``.
        index (LongTensor, optional): group id per output coordinate.
        min_scale (float): floor :math:`\sigma_{\min}` added to every scale.

    Shapes:
        features: ``(*batch, in_features)``; constraint_value: ``(*batch, a)`` (or broadcastable);
        returns a distribution with ``batch_shape = broadcast(*batch)`` and ``event_shape = (n,)``.

    Example:
        >>> head = ConstrainedGaussianHead(8, 4, constraint_matrix=torch.ones(1, 4))
        >>> dist = head(torch.randn(16, 8), torch.ones(16, 1))
        >>> dist.batch_shape, bool(torch.allclose(dist.mean.sum(-1), torch.ones(16)))
        (torch.Size([16]), True)
    """

    def __init__(self, in_features: int, out_features: int, *, constraint_matrix: Tensor | None = None,
                 index: Tensor | None = None, min_scale: float = 1e-4) -> None:
        super().__init__()
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
            groups = int(index.max()) + 1 if isinstance(index, Tensor) and index.numel() else 0
            SumConstraint(index, torch.zeros(groups))  # validates index
            if index.shape[0] != out_features:
                raise ValueError(f"index must have shape ({out_features},), got {tuple(index.shape)}.")
            self.register_buffer("index", index.clone())
            self.constraint_matrix = None
        self.in_features, self.out_features, self.min_scale = in_features, out_features, min_scale
        self.linear = nn.Linear(in_features, 2 * out_features)

    @property
    def num_constraints(self) -> int:
        if self.constraint_matrix is not None:
            return self.constraint_matrix.shape[-2]
        return int(self.index.max()) + 1

    def constraint(self, constraint_value: Tensor) -> EqualityConstraint:
        """The constraint object for right-hand side ``constraint_value``."""
        if self.constraint_matrix is not None:
            return LinearConstraint(self.constraint_matrix.to(constraint_value.dtype), constraint_value,
                                    validate_args=False)
        return SumConstraint(self.index, constraint_value, validate_args=False)

    def forward(self, features: Tensor, constraint_value: Tensor) -> ConstrainedNormal:
        if features.shape[-1] != self.in_features:
            raise ValueError(f"features must have shape (..., {self.in_features}), got {tuple(features.shape)}.")
        if constraint_value.shape[-1] != self.num_constraints:
            raise ValueError(f"constraint_value must have shape (..., {self.num_constraints}), got "
                             f"{tuple(constraint_value.shape)}.")
        loc, raw_scale = self.linear(features).chunk(2, dim=-1)
        scale = F.softplus(raw_scale) + self.min_scale
        # under torch.autocast the layer returns bfloat16 / float16: promote to the widest of the three, so a
        # float32 right-hand side gives a float32 distribution (half-precision ones compute in float32 anyway)
        dtype = torch.promote_types(torch.promote_types(loc.dtype, scale.dtype), constraint_value.dtype)
        return ConstrainedNormal(loc.to(dtype), scale.to(dtype), constraint=self.constraint(constraint_value.to(dtype)))

    def extra_repr(self) -> str:
        kind = "dense" if self.constraint_matrix is not None else "sum"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"a={self.num_constraints}, constraint={kind}")
