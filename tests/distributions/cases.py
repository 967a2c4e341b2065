"""Random ConstrainedNormal instances with their dense parameters, for oracle tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import hardeq

STRUCTURES = ("diag", "full", "lowrank")
CONSTRAINTS = ("linear", "sum")


@dataclass
class Case:
    dist: hardeq.ConstrainedNormal
    loc: torch.Tensor  # (*batch, n)
    cov: torch.Tensor  # (*batch, n, n) dense Sigma
    A: torch.Tensor  # (a, n) or (*batch, a, n)
    k: torch.Tensor  # (*batch, a)
    params: dict


def make_case(structure="diag", kind="linear", batch_shape=(), n=5, a=2, dtype=torch.float64, seed=0,
              rank=2, requires_grad=False) -> Case:
    g = torch.Generator().manual_seed(seed)
    batch_shape = torch.Size(batch_shape)
    loc = torch.randn(batch_shape + (n,), dtype=dtype, generator=g)
    if kind == "linear":
        A = torch.randn(a, n, dtype=dtype, generator=g)
    else:
        index = torch.cat([torch.arange(a), torch.randint(0, a, (n - a,), generator=g)])
        A = torch.nn.functional.one_hot(index, a).T.to(dtype)
    z_feasible = torch.randn(batch_shape + (n,), dtype=dtype, generator=g)
    k = z_feasible @ A.T
    params = {"loc": loc}
    if structure == "diag":
        scale = 0.5 + torch.rand(batch_shape + (n,), dtype=dtype, generator=g)
        params["scale"] = scale
        cov = torch.diag_embed(scale**2)
    elif structure == "full":
        X = torch.randn(batch_shape + (n, n), dtype=dtype, generator=g)
        cov = X @ X.mT / n + 0.5 * torch.eye(n, dtype=dtype)
        params["scale_tril"] = torch.linalg.cholesky(cov)
    else:
        W = torch.randn(batch_shape + (n, rank), dtype=dtype, generator=g) * 0.7
        scale = 0.5 + torch.rand(batch_shape + (n,), dtype=dtype, generator=g)
        params["cov_factor"], params["scale"] = W, scale
        cov = W @ W.mT + torch.diag_embed(scale**2)
    if requires_grad:
        for v in params.values():
            v.requires_grad_(True)
    constraint = (hardeq.LinearConstraint(A, k) if kind == "linear"
                  else hardeq.SumConstraint(index, k))
    loc_arg = params.pop("loc")
    dist = hardeq.ConstrainedNormal(loc_arg, constraint=constraint, **params)
    params["loc"] = loc_arg
    return Case(dist, loc, cov, A, k, params)


def all_cases():
    return [(s, c) for s in STRUCTURES for c in CONSTRAINTS]
