r"""Covariance structures of the unconditioned Gaussian :math:`\mathcal N(\mu, \Sigma)`.

Each structure applies :math:`\Sigma`, a square root of it, its inverse and its log-determinant without
forming an ``n x n`` matrix unless the user supplied one (``scale_tril``).

* :class:`DiagonalCovariance`: :math:`\Sigma = \mathrm{diag}(\sigma^2)`.
* :class:`FullCovariance`: :math:`\Sigma = L L^\top` with ``L`` lower triangular.
* :class:`LowRankCovariance`: :math:`\Sigma = W W^\top + \mathrm{diag}(\sigma^2)` (``W``: ``n x r``);
  square root :math:`F = [\mathrm{diag}(\sigma), W]` (``n x (n + r)``);
  inverse and log-determinant through the ``r x r`` capacitance matrix (Woodbury), as in
  :class:`torch.distributions.LowRankMultivariateNormal`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from .._utils import batch_mv

__all__ = ["Covariance", "DiagonalCovariance", "FullCovariance", "LowRankCovariance"]


class Covariance(ABC):
    """Interface shared by the covariance structures (see the module docstring)."""

    event_size: int
    noise_size: int
    batch_shape: torch.Size

    @abstractmethod
    def diagonal(self) -> Tensor:  # (*batch, n)
        ...

    @abstractmethod
    def matvec(self, x: Tensor) -> Tensor:  # Sigma x
        ...

    @abstractmethod
    def sqrt_matvec(self, noise: Tensor) -> Tensor:  # F eps, eps of size noise_size
        ...

    @abstractmethod
    def sqrt_matmul(self, X: Tensor) -> Tensor:  # F X: (*batch, noise_size, m) -> (*batch, n, m)
        ...

    @abstractmethod
    def sqrt_t_matmul(self, Y: Tensor) -> Tensor:  # F^T Y: (*batch, n, m) -> (*batch, noise_size, m)
        ...

    @abstractmethod
    def inv_matvec(self, x: Tensor) -> Tensor:  # Sigma^{-1} x
        ...

    def inv_quad(self, x: Tensor) -> Tensor:  # x^T Sigma^{-1} x
        return (x * self.inv_matvec(x)).sum(-1)

    @abstractmethod
    def logdet(self) -> Tensor:
        ...

    @abstractmethod
    def right_apply(self, A: Tensor) -> Tensor:  # A Sigma for dense A (*batch, a, n)
        ...

    @abstractmethod
    def dense(self) -> Tensor:
        ...

    @abstractmethod
    def trace_inv_mul(self, other: "Covariance") -> Tensor:
        r""":math:`\mathrm{tr}(\Sigma_{self}^{-1} \Sigma_{other})`."""
        ...


class DiagonalCovariance(Covariance):
    def __init__(self, scale: Tensor) -> None:
        self.scale = scale  # (*batch, n)
        self.variance = scale.square()
        self.event_size = self.noise_size = scale.shape[-1]
        self.batch_shape = scale.shape[:-1]

    def diagonal(self) -> Tensor:
        return self.variance

    def matvec(self, x: Tensor) -> Tensor:
        return self.variance * x

    def sqrt_matvec(self, noise: Tensor) -> Tensor:
        return self.scale * noise

    def sqrt_matmul(self, X: Tensor) -> Tensor:
        return self.scale.unsqueeze(-1) * X

    sqrt_t_matmul = sqrt_matmul

    def inv_matvec(self, x: Tensor) -> Tensor:
        return x / self.variance

    def inv_quad(self, x: Tensor) -> Tensor:
        return (x / self.scale).square().sum(-1)

    def logdet(self) -> Tensor:
        return 2 * self.scale.log().sum(-1)

    def right_apply(self, A: Tensor) -> Tensor:
        return A * self.variance.unsqueeze(-2)

    def dense(self) -> Tensor:
        return torch.diag_embed(self.variance)

    def inv_diagonal(self) -> Tensor:
        return 1 / self.variance

    def trace_inv_mul(self, other: Covariance) -> Tensor:
        if isinstance(other, DiagonalCovariance):
            return (other.variance / self.variance).sum(-1)
        return (other.diagonal() / self.variance).sum(-1)


class FullCovariance(Covariance):
    def __init__(self, scale_tril: Tensor) -> None:
        self.scale_tril = scale_tril  # (*batch, n, n)
        self.event_size = self.noise_size = scale_tril.shape[-1]
        self.batch_shape = scale_tril.shape[:-2]

    def diagonal(self) -> Tensor:
        return self.scale_tril.square().sum(-1)

    def matvec(self, x: Tensor) -> Tensor:
        return batch_mv(self.scale_tril, batch_mv(self.scale_tril.mT, x))

    def sqrt_matvec(self, noise: Tensor) -> Tensor:
        return batch_mv(self.scale_tril, noise)

    def sqrt_matmul(self, X: Tensor) -> Tensor:
        return self.scale_tril @ X

    def sqrt_t_matmul(self, Y: Tensor) -> Tensor:
        return self.scale_tril.mT @ Y

    def _whiten(self, x: Tensor) -> Tensor:
        from .triangular import tri_solve_vec

        return tri_solve_vec(self.scale_tril, x, upper=False)

    def inv_matvec(self, x: Tensor) -> Tensor:
        from .triangular import tri_solve_vec

        return tri_solve_vec(self.scale_tril.mT, self._whiten(x), upper=True)

    def inv_quad(self, x: Tensor) -> Tensor:
        return self._whiten(x).square().sum(-1)

    def logdet(self) -> Tensor:
        return 2 * self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    def right_apply(self, A: Tensor) -> Tensor:
        return (A @ self.scale_tril) @ self.scale_tril.mT

    def dense(self) -> Tensor:
        return self.scale_tril @ self.scale_tril.mT

    def inv_diagonal(self) -> Tensor:
        eye = torch.eye(self.event_size, dtype=self.scale_tril.dtype, device=self.scale_tril.device)
        Linv = torch.linalg.solve_triangular(self.scale_tril, eye, upper=False)
        return Linv.square().sum(-2)

    def trace_inv_mul(self, other: Covariance) -> Tensor:
        if isinstance(other, FullCovariance):
            M = torch.linalg.solve_triangular(self.scale_tril, other.scale_tril, upper=False)
            return M.square().sum((-2, -1))
        if isinstance(other, DiagonalCovariance):
            return (self.inv_diagonal() * other.variance).sum(-1)
        if isinstance(other, LowRankCovariance):
            M = torch.linalg.solve_triangular(self.scale_tril, other.cov_factor, upper=False)
            return (self.inv_diagonal() * other.cov_diag).sum(-1) + M.square().sum((-2, -1))
        raise TypeError(f"unsupported covariance {type(other).__name__}")


class LowRankCovariance(Covariance):
    def __init__(self, cov_factor: Tensor, scale: Tensor) -> None:
        self.cov_factor = cov_factor  # W: (*batch, n, r)
        self.scale = scale  # (*batch, n)
        self.cov_diag = scale.square()
        self.event_size = scale.shape[-1]
        self.rank = cov_factor.shape[-1]
        self.noise_size = self.event_size + self.rank
        self.batch_shape = torch.broadcast_shapes(cov_factor.shape[:-2], scale.shape[:-1])

    @property
    def _capacitance_tril(self) -> Tensor:
        # C = I + W^T D^{-1} W (r x r), cached after the first use
        if not hasattr(self, "_cap_tril"):
            W = self.cov_factor
            Wt_Dinv = W.mT / self.cov_diag.unsqueeze(-2)
            cap = Wt_Dinv @ W
            cap = cap + torch.eye(self.rank, dtype=W.dtype, device=W.device)
            self._cap_tril = torch.linalg.cholesky(cap)
        return self._cap_tril

    def diagonal(self) -> Tensor:
        return self.cov_factor.square().sum(-1) + self.cov_diag

    def matvec(self, x: Tensor) -> Tensor:
        return batch_mv(self.cov_factor, batch_mv(self.cov_factor.mT, x)) + self.cov_diag * x

    def sqrt_matvec(self, noise: Tensor) -> Tensor:
        n = self.event_size
        eps_d, eps_w = noise[..., :n], noise[..., n:]
        return batch_mv(self.cov_factor, eps_w) + self.scale * eps_d

    def sqrt_matmul(self, X: Tensor) -> Tensor:
        n = self.event_size
        return self.scale.unsqueeze(-1) * X[..., :n, :] + self.cov_factor @ X[..., n:, :]

    def sqrt_t_matmul(self, Y: Tensor) -> Tensor:
        top = self.scale.unsqueeze(-1) * Y
        bottom = self.cov_factor.mT @ Y
        shape = torch.broadcast_shapes(top.shape[:-2], bottom.shape[:-2])
        return torch.cat([top.expand(shape + top.shape[-2:]), bottom.expand(shape + bottom.shape[-2:])], dim=-2)

    def inv_matvec(self, x: Tensor) -> Tensor:
        from .triangular import tri_solve_vec

        # Woodbury: Sigma^{-1} = D^{-1} - D^{-1} W C^{-1} W^T D^{-1}
        Dinv_x = x / self.cov_diag
        t = tri_solve_vec(self._capacitance_tril, batch_mv(self.cov_factor.mT, Dinv_x), upper=False)
        t = tri_solve_vec(self._capacitance_tril.mT, t, upper=True)
        return Dinv_x - batch_mv(self.cov_factor, t) / self.cov_diag

    def logdet(self) -> Tensor:
        cap_logdet = 2 * self._capacitance_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return cap_logdet + self.cov_diag.log().sum(-1)

    def right_apply(self, A: Tensor) -> Tensor:
        W = self.cov_factor
        return A * self.cov_diag.unsqueeze(-2) + (A @ W) @ W.mT

    def dense(self) -> Tensor:
        W = self.cov_factor
        return W @ W.mT + torch.diag_embed(self.cov_diag)

    def inv_diagonal(self) -> Tensor:
        # diag(D^{-1} W C^{-1} W^T D^{-1}) = row norms of D^{-1} W L_C^{-T}
        Dinv_W = self.cov_factor / self.cov_diag.unsqueeze(-1)
        M = torch.linalg.solve_triangular(self._capacitance_tril, Dinv_W.mT, upper=False)  # (r, n)
        return 1 / self.cov_diag - M.square().sum(-2)

    def inv_quad_matrix(self, X: Tensor) -> Tensor:
        r""":math:`\mathrm{tr}(X^\top \Sigma^{-1} X)` for ``X`` of shape ``(*batch, n, m)`` (Woodbury)."""
        Dinv_X = X / self.cov_diag.unsqueeze(-1)
        M = torch.linalg.solve_triangular(self._capacitance_tril, self.cov_factor.mT @ Dinv_X, upper=False)
        return (X * Dinv_X).sum((-2, -1)) - M.square().sum((-2, -1))

    def trace_inv_mul(self, other: Covariance) -> Tensor:
        if isinstance(other, DiagonalCovariance):
            return (self.inv_diagonal() * other.variance).sum(-1)
        if isinstance(other, LowRankCovariance):
            return (self.inv_diagonal() * other.cov_diag).sum(-1) + self.inv_quad_matrix(other.cov_factor)
        if isinstance(other, FullCovariance):
            return self.inv_quad_matrix(other.scale_tril)
        raise TypeError(f"unsupported covariance {type(other).__name__}")
