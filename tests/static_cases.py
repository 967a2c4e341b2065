"""Inputs of the static and grouped hot paths, shared by the host-synchronisation and CUDA-graph tests."""

from __future__ import annotations

import torch

import hardeq

#: (constraint kind, covariance form) pairs of the hot paths: dense A (Cholesky), SumConstraint (grouped, O(n))
HOT_PATHS = [("linear", "diag"), ("sum", "diag"), ("linear", "lowrank"), ("linear", "full"), ("sum", "lowrank")]


def hot_inputs(kind: str, cov: str, dtype: torch.dtype, *, batch: int = 3, n: int = 40, a: int = 4, seed: int = 0,
               requires_grad: bool = False) -> dict:
    """Tensors of one hot-path case on the default device: ``loc``, ``k`` ``(batch, n)``/``(batch, a)``, the
    covariance's tensors, the constraint's ``A`` or group ``index``, and noise ``eps`` ``(2, batch, noise_size)``.
    Well conditioned (scales in [0.5, 1.5], Gaussian ``A``, groups of ``n / a``), as the static mode requires."""
    g = torch.Generator().manual_seed(seed)
    out = {"loc": torch.randn(batch, n, generator=g, dtype=dtype), "k": torch.randn(batch, a, generator=g, dtype=dtype),
           "scale": 0.5 + torch.rand(batch, n, generator=g, dtype=dtype)}
    if kind == "linear":
        out["A"] = torch.randn(a, n, generator=g, dtype=dtype)
    else:
        out["index"] = torch.arange(n) % a
    noise_size = n
    if cov == "lowrank":
        out["cov_factor"] = 0.3 * torch.randn(n, 2, generator=g, dtype=dtype)
        noise_size = n + 2
    elif cov == "full":
        X = torch.randn(n, n, generator=g, dtype=dtype) / n ** 0.5
        out["scale_tril"] = torch.linalg.cholesky(X @ X.mT + 0.5 * torch.eye(n, dtype=dtype))
        del out["scale"]
    out["eps"] = torch.randn(2, batch, noise_size, generator=g, dtype=dtype)
    if requires_grad:
        for name in ("loc", "scale", "cov_factor", "scale_tril"):
            if name in out:
                out[name].requires_grad_(True)
    return out


def build(kind: str, cov: str, t: dict, *, validate_args: bool = False) -> hardeq.ConstrainedNormal:
    """``ConstrainedNormal`` of the inputs ``t`` (:func:`hot_inputs`); the constraint built with the same
    ``validate_args``."""
    if kind == "linear":
        con = hardeq.LinearConstraint(t["A"], t["k"], validate_args=validate_args)
    else:
        con = hardeq.SumConstraint(t["index"], t["k"], validate_args=validate_args)
    params = {name: t[name] for name in ("scale", "cov_factor", "scale_tril") if name in t}
    return hardeq.ConstrainedNormal(t["loc"], constraint=con, validate_args=validate_args, **params)
