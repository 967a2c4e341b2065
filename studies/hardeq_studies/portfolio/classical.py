r"""Classical allocations on the same windows (no training): equal weight, Markowitz, minimum variance.

Both Markowitz variants estimate from the window's *input* days only (the ``W - 1`` daily returns before the
decision, :attr:`Windows.past_returns`), annualised with 252 days, with the Ledoit-Wolf (2004) shrinkage of
the covariance towards a scaled identity (the sample covariance is singular when ``N >= W - 1``):

* ``Markowitz``: the long-only maximum-Sharpe (tangency) portfolio,
  :math:`\max_{w \ge 0, 1^\top w = 1} (w^\top\hat\mu - r_f)/\sqrt{w^\top\hat\Sigma w}`, solved by projected
  gradient ascent on the simplex (batched over windows);
* ``min-variance``: the global minimum-variance portfolio with shorting,
  :math:`w = \hat\Sigma^{-1}1 / (1^\top\hat\Sigma^{-1}1)` (closed form).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["CLASSICAL", "ledoit_wolf", "project_simplex", "equal_weight", "max_sharpe_long_only",
           "min_variance", "classical_weights"]

#: the classical methods, in table order
CLASSICAL = ("equal-weight", "Markowitz", "min-variance")


def ledoit_wolf(x: Tensor) -> Tensor:
    r"""Ledoit-Wolf shrunk covariance of samples ``x`` ``(..., T, N)`` (``T`` observations): ``(..., N, N)``.

    :math:`\hat\Sigma = \delta m I + (1 - \delta) S`, ``S`` the (1/T) sample covariance, ``m = tr(S)/N``,
    :math:`\delta = \min(\bar b^2, d^2)/d^2` with :math:`d^2 = \|S - mI\|_F^2` and
    :math:`\bar b^2 = T^{-2}\sum_t \|x_t x_t^\top - S\|_F^2`."""
    T, N = x.shape[-2], x.shape[-1]
    if T < 2:
        raise ValueError(f"x needs at least 2 observations, got shape {tuple(x.shape)}.")
    xc = x - x.mean(-2, keepdim=True)
    S = xc.transpose(-1, -2) @ xc / T
    eye = torch.eye(N, dtype=x.dtype, device=x.device)
    m = torch.diagonal(S, dim1=-2, dim2=-1).sum(-1) / N  # (...,)
    d2 = (S - m[..., None, None] * eye).square().sum((-2, -1))
    sq = xc.square().sum(-1)  # (..., T) ||x_t||^2
    xSx = torch.einsum("...ti,...ij,...tj->...t", xc, S, xc)
    b2 = (sq.square() - 2 * xSx + S.square().sum((-2, -1))[..., None]).sum(-1) / T**2
    delta = (torch.minimum(b2, d2) / d2.clamp_min(1e-300)).clamp(0, 1)
    return delta[..., None, None] * m[..., None, None] * eye + (1 - delta[..., None, None]) * S


def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of every row of ``v`` ``(..., N)`` onto ``{w >= 0, sum w = 1}`` (sort-based)."""
    N = v.shape[-1]
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = u.cumsum(-1) - 1
    k = torch.arange(1, N + 1, dtype=v.dtype, device=v.device)
    cond = u - css / k > 0
    rho = (cond * k).argmax(-1, keepdim=True)  # last index where cond holds
    theta = css.gather(-1, rho) / (rho + 1).to(v.dtype)
    return (v - theta).clamp_min(0)


def equal_weight(batch: int, n: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """``(batch, n)`` weights ``1 / n``."""
    return torch.full((batch, n), 1.0 / n, dtype=dtype)


def _estimates(past_returns: Tensor, days: int) -> tuple[Tensor, Tensor]:
    mu = days * past_returns.mean(-2)
    cov = days * ledoit_wolf(past_returns)
    return mu, cov


def max_sharpe_long_only(past_returns: Tensor, *, rf: float = 0.03, days: int = 252, steps: int = 2000,
                         lr: float = 0.05) -> Tensor:
    """Long-only maximum-Sharpe weights ``(B, N)`` from past daily returns ``(B, T, N)`` (float64 inside).

    Projected gradient ascent from equal weights with step ``lr / ||grad||_inf`` (scale-free), decayed as
    ``1/sqrt(1 + i/100)``; the best iterate is kept."""
    r = past_returns.to(torch.float64)
    mu, cov = _estimates(r, days)
    B, N = mu.shape
    w = equal_weight(B, N)
    best, best_val = w.clone(), torch.full((B,), -math.inf, dtype=torch.float64)
    for i in range(steps):
        w.requires_grad_(True)
        val = (torch.einsum("bn,bn->b", w, mu) - rf) / torch.sqrt(torch.einsum("bi,bij,bj->b", w, cov, w))
        (g,) = torch.autograd.grad(val.sum(), w)
        with torch.no_grad():
            better = val > best_val
            best[better], best_val[better] = w[better], val[better]
            step = lr / math.sqrt(1 + i / 100) / g.abs().amax(-1, keepdim=True).clamp_min(1e-300)
            w = project_simplex(w + step * g)
    return best.detach()


def min_variance(past_returns: Tensor, *, days: int = 252) -> Tensor:
    """Global minimum-variance weights with shorting, ``(B, N)``, from past daily returns ``(B, T, N)``."""
    _, cov = _estimates(past_returns.to(torch.float64), days)
    ones = torch.ones(cov.shape[:-1] + (1,), dtype=cov.dtype)
    x = torch.linalg.solve(cov, ones)[..., 0]
    return x / x.sum(-1, keepdim=True)


def classical_weights(method: str, past_returns: Tensor, *, rf: float = 0.03, days: int = 252) -> Tensor:
    """Weights ``(B, N)`` (float64) of classical ``method`` (:data:`CLASSICAL`) for every window."""
    if method == "equal-weight":
        return equal_weight(past_returns.shape[0], past_returns.shape[-1])
    if method == "Markowitz":
        return max_sharpe_long_only(past_returns, rf=rf, days=days)
    if method == "min-variance":
        return min_variance(past_returns, days=days)
    raise ValueError(f"method must be one of {list(CLASSICAL)}, got {method!r}.")
