"""Small truncated problems for the bounds tests: every covariance structure x constraint type, feasible by
construction (k = A z* for a z* strictly inside the box), with a dense float64 picture for the oracles."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from hardeq import BlockDiagonalCovariance, ConstrainedNormal, LinearConstraint, SparseConstraint, SumConstraint

COVARIANCES = ("diag", "full", "lowrank", "block")
CONSTRAINTS = ("dense", "sum", "sparse")
DTYPES = (torch.float32, torch.float64)
#: the library's per-row tolerance, by dtype
ROW_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def make_case(cov: str, con: str, dtype: torch.dtype, *, n: int = 6, batch: tuple = (2,), seed: int = 0,
              spread: float = 1.0, mean_offset: float = 0.6):
    """``(dist, lower, upper)``: a ConstrainedNormal and a box (lower finite, upper finite except one coordinate)."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=f64)

    lower = torch.zeros(n, dtype=f64)
    upper = torch.ones(n, dtype=f64)
    upper[-1] = float("inf")
    if con == "sum":
        index = torch.arange(n) * 2 // n  # two groups
        a = 2
        A = torch.nn.functional.one_hot(index, a).T.to(f64)
    else:
        a = 2
        A = r(a, n)
        A[0, 1] = 0.0
        A[1, 0] = 0.0
    inner = 0.2 + 0.6 * torch.rand(batch + (n,), generator=g, dtype=f64)  # strictly inside the box
    k = (A @ inner.unsqueeze(-1)).squeeze(-1)
    loc = inner + mean_offset * r(*batch, n)
    scale = torch.exp(spread * r(*batch, n)) * 0.5
    if cov == "diag":
        kw = {"scale": scale.to(dtype)}
    elif cov == "full":
        L = torch.tril(0.3 * r(*batch, n, n), -1) + torch.diag_embed(scale)
        kw = {"scale_tril": L.to(dtype)}
    elif cov == "lowrank":
        kw = {"cov_factor": (0.4 * r(*batch, n, 2)).to(dtype), "scale": scale.to(dtype)}
    elif cov == "block":
        kw = {"covariance": BlockDiagonalCovariance(torch.arange(n) * 3 // n, (0.4 * r(*batch, n, 1)).to(dtype),
                                                    scale.to(dtype))}
    else:
        raise ValueError(cov)
    if con == "sum":
        constraint = SumConstraint(index, k.to(dtype))
    elif con == "dense":
        constraint = LinearConstraint(A.to(dtype), k.to(dtype))
    else:
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            constraint = SparseConstraint(A.to(dtype).to_sparse_csr(), k.to(dtype))
    dist = ConstrainedNormal(loc.to(dtype), constraint=constraint, **kw)
    return dist, lower.to(dtype), upper.to(dtype)


def dense_picture(dist):
    """``(mu, Sigma, A, k)`` as float64 numpy arrays with the batch flattened: ``(B, n)``, ``(B, n, n)``,
    ``(B, a, n)``, ``(B, a)`` (test oracle only; forms Sigma densely)."""
    batch, n = dist.batch_shape, dist.event_shape[0]
    B = batch.numel()
    mu = dist.loc.detach().to(torch.float64).reshape(B, n)
    Sigma = dist.covariance.to(dtype=torch.float64).dense().detach().expand(batch + (n, n)).reshape(B, n, n)
    A = dist.constraint.to(dtype=torch.float64).dense_matrix().detach()
    A = A.expand(batch + A.shape[-2:]).reshape(B, *A.shape[-2:])
    k = dist.constraint.k.detach().to(torch.float64).expand(batch + A.shape[-2:-1]).reshape(B, -1)
    return mu.numpy(), Sigma.numpy(), A.numpy(), k.numpy()


def rows_ok(dist, z: torch.Tensor) -> torch.Tensor:
    """Per-row criterion of the library, ``|(Az - k)_i| <= tol (|A||z|)_i + tiny``, checked in float64."""
    con = dist.constraint.to(dtype=torch.float64)
    z64 = z.to(torch.float64)
    r = (con.matvec(z64) - con.k).abs()
    scale = con.abs_matvec(z64.abs())
    return (r <= ROW_RTOL[z.dtype] * scale + 1e-300).all(-1)


def brute_force_mode(mu, Sigma, A, k, lo, hi):
    """Exact QP minimiser by enumerating every active set (each coordinate free, at lower or at upper) and
    solving the primal KKT system [[P, R^T], [R, 0]]; the smallest objective among feasible candidates. numpy,
    float64; n <= 7."""
    import itertools

    n = mu.shape[0]
    P = np.linalg.inv(Sigma)
    best, best_obj = None, np.inf
    choices = [[0] + ([1] if np.isfinite(lo[i]) else []) + ([2] if np.isfinite(hi[i]) else []) for i in range(n)]
    for pattern in itertools.product(*choices):
        rows = [A]
        rhs = [k]
        for i, s in enumerate(pattern):
            if s:
                e = np.zeros((1, n))
                e[0, i] = 1.0
                rows.append(e)
                rhs.append(np.array([lo[i] if s == 1 else hi[i]]))
        R = np.concatenate(rows, 0)
        if R.shape[0] > n or np.linalg.matrix_rank(R) < R.shape[0]:
            continue
        m = R.shape[0]
        K = np.block([[P, R.T], [R, np.zeros((m, m))]])
        sol = np.linalg.solve(K, np.concatenate([P @ mu, np.concatenate(rhs)]))
        z = sol[:n]
        if np.all(z >= lo - 1e-10) and np.all(z <= hi + 1e-10):
            obj = (z - mu) @ P @ (z - mu)
            if obj < best_obj - 1e-13 * max(1.0, abs(obj)):
                best, best_obj = z, obj
    return best, best_obj


def numpy_rejection(mu, Sigma, A, k, lo, hi, num, rng, max_rounds=10_000):
    """Naive rejection oracle in numpy: the conditional N(mu_bar, Sigma_bar) from dense formulas (eigh square
    root of the rank-(n - a) covariance), kept when in the box. Returns ``(num, n)``."""
    S = A @ Sigma @ A.T
    K = Sigma @ A.T @ np.linalg.inv(S)
    mu_bar = mu + K @ (k - A @ mu)
    Sig_bar = Sigma - K @ A @ Sigma
    Sig_bar = 0.5 * (Sig_bar + Sig_bar.T)
    w, V = np.linalg.eigh(Sig_bar)
    F = V * np.sqrt(np.clip(w, 0, None))
    out = []
    total = 0
    for _ in range(max_rounds):
        z = mu_bar + rng.standard_normal((4 * num, mu.shape[0])) @ F.T
        z = z[np.all((z >= lo) & (z <= hi), axis=1)]
        out.append(z)
        total += z.shape[0]
        if total >= num:
            break
    return np.concatenate(out, 0)[:num]


__all__ = ["COVARIANCES", "CONSTRAINTS", "DTYPES", "ROW_RTOL", "make_case", "dense_picture", "rows_ok",
           "brute_force_mode", "numpy_rejection"]
