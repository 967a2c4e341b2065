"""The ``synthetic`` task: gradient estimates, their ground truth, and the metrics comparing them."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from .data import Problem, derived_seed, estimator_specs, problem, seeded_generator

__all__ = ["cosine", "gradient_metrics", "ground_truth", "estimates", "run_block"]


# --------------------------------------------------------------------------------------------- metrics
def cosine(u: Tensor, v: Tensor) -> Tensor:
    """Cosine similarity along the last dimension, broadcasting; 0 where ``u`` or ``v`` is exactly zero."""
    u, v = torch.broadcast_tensors(u, v)
    denom = torch.linalg.vector_norm(u, dim=-1) * torch.linalg.vector_norm(v, dim=-1)
    dot = (u * v).sum(-1)
    positive = denom > 0
    return torch.where(positive, dot / torch.where(positive, denom, torch.ones_like(denom)),
                       torch.zeros_like(denom)).clamp(-1, 1)


def gradient_metrics(h: Tensor, h_gt: Tensor) -> dict[str, Tensor]:
    """Per-set metrics of ``N`` estimates ``h`` ``(sets, N, d)`` against the truth ``h_gt`` ``(sets, d)``.

    Returns tensors of shape ``(sets,)``: ``bias``, ``variance``, ``average_error``, ``bias_ratio``,
    ``zero_fraction`` (definitions in the module docstring).
    """
    if h.dim() != 3 or h_gt.dim() != 2 or h.shape[0] != h_gt.shape[0] or h.shape[2] != h_gt.shape[1]:
        raise ValueError(f"expected h (sets, N, d) and h_gt (sets, d), got {tuple(h.shape)} and {tuple(h_gt.shape)}.")
    N = h.shape[1]
    if N < 2:
        raise ValueError(f"need at least 2 estimates per set, got N = {N}.")
    mean = h.mean(1)
    bias = 1 - cosine(mean, h_gt)
    variance = (1 - cosine(h, mean.unsqueeze(1))).var(1, correction=1)
    average_error = (1 - cosine(h, h_gt.unsqueeze(1))).mean(1)
    # Monte Carlo test of unbiasedness: E||mean - h_gt||^2 = tr Cov / N exactly when E h = h_gt.
    trace_se = h.var(1, correction=1).sum(-1) / N
    err2 = (mean - h_gt).square().sum(-1)
    tol = (1e-12 * (torch.linalg.vector_norm(h_gt, dim=-1) + 1)).square()
    positive = trace_se > 0
    ratio = torch.where(positive, err2 / torch.where(positive, trace_se, torch.ones_like(trace_se)),
                        torch.where(err2 <= tol, torch.zeros_like(err2), torch.full_like(err2, math.inf)))
    zero_fraction = (torch.linalg.vector_norm(h, dim=-1) == 0).to(h.dtype).mean(1)
    return {"bias": bias, "variance": variance, "average_error": average_error,
            "bias_ratio": ratio, "zero_fraction": zero_fraction}



def _loss(z: Tensor, y: Tensor, loss: str) -> Tensor:
    if loss == "l1":
        return (z - y).abs()
    if loss == "l2":
        return (z - y).square()
    raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}.")


def _gradients(out: Tensor, leaves: dict[str, Tensor], targets: dict[str, tuple[str, ...]]) -> dict[str, Tensor]:
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[k] for k in names], allow_unused=True)
    grads = {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(names, grads)}
    return {t: torch.cat([grads[k] for k in keys], -1) for t, keys in targets.items()}


def ground_truth(problem: Problem, loss: str) -> dict[str, Tensor]:
    """``h_gt`` per gradient target, ``(sets, d)``: autograd of the summed closed-form expected loss."""
    if loss not in ("l1", "l2"):
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}.")
    leaves = {k: v.detach().clone().requires_grad_() for k, v in problem.params.items()}
    dist = problem.distribution(leaves, slice(None), per_sample=False)
    expected = dist.expected_l1(problem.y) if loss == "l1" else dist.expected_l2(problem.y)
    return _gradients(expected.sum(), leaves, problem.targets)


def estimates(problem: Problem, loss: str, spec: tuple[str, str, str | None], n_estimates: int,
              sets: slice = slice(None), *, noise: Tensor | None = None,
              proxy_noise: Tensor | None = None) -> dict[str, Tensor]:
    """``N`` estimates ``h_i`` per gradient target, ``(sets, N, d)``, from ONE batched call: per-sample
    parameter leaves ``(sets, N, n)``, one exact sample per batch element, one backward pass.

    ``noise`` (Gaussian: the forward ``eps``, ``(sets, N, n)``) and ``proxy_noise`` (``eps'``) are drawn from
    torch's global generator when not given.
    """
    name, base, proxy = spec
    leaves = {k: v[sets].detach().unsqueeze(1).expand(-1, n_estimates, -1).clone().requires_grad_()
              for k, v in problem.params.items()}
    dist = problem.distribution(leaves, sets, per_sample=True)
    kwargs: dict[str, Any] = {}
    if problem.family == "gaussian":
        shape = dist.batch_shape + (dist.noise_size,)
        kwargs["noise"] = torch.randn(shape, dtype=problem.y.dtype) if noise is None else noise
        if proxy == "independent":
            kwargs["proxy_noise"] = torch.randn(shape, dtype=problem.y.dtype) if proxy_noise is None else proxy_noise
    elif proxy is not None:
        raise ValueError(f"estimator variant {name!r}: proxy noise is not supported for the Poisson family.")
    z = dist.rsample(estimator=base, **kwargs)
    return _gradients(_loss(z, problem.y[sets].unsqueeze(1), loss).sum(), leaves, problem.targets)



def run_block(config: dict, family: str, case: str, loss: str, seed: int | None = None,
              progress: Callable[[str], None] | None = None) -> list[dict]:
    """Records of one ``(family, case, loss)`` block: every estimator, target and metric. Deterministic
    given ``(config, seed)``; torch's global generator is reseeded inside and restored on exit."""
    with torch.random.fork_rng(devices=[]):
        return _run_block(config, family, case, loss, config["seed"] if seed is None else seed, progress)


def _run_block(config: dict, family: str, case: str, loss: str, seed: int,
               progress: Callable[[str], None] | None) -> list[dict]:
    S, N = config["n_sets"], config["n_estimates"]
    chunk = max(1, int(config.get("sets_per_chunk", S)))
    prob = problem(config, family, case, S, seed)
    truth = ground_truth(prob, loss)
    gt_zero = {t: int((torch.linalg.vector_norm(g, dim=-1) == 0).sum()) for t, g in truth.items()}
    noise_gen = seeded_generator(seed, family, case, "noise")
    specs = estimator_specs(family, config)
    per_set: dict[tuple[str, str], dict[str, list[Tensor]]] = {}
    for start in range(0, S, chunk):
        sets = slice(start, min(S, start + chunk))
        s = sets.stop - sets.start
        noise = proxy_noise = None
        if family == "gaussian":
            n = config["gaussian"]["n"]
            noise = torch.randn(s, N, n, generator=noise_gen, dtype=prob.y.dtype)
            proxy_noise = torch.randn(s, N, n, generator=noise_gen, dtype=prob.y.dtype)
        for spec in specs:
            # Same global-generator state for every estimator and loss: the Poisson forward sample (drawn
            # from it by rsample) is then shared too; `random` draws its noise after the sample.
            torch.manual_seed(derived_seed(seed, family, case, "estimates", start))
            h = estimates(prob, loss, spec, N, sets, noise=noise, proxy_noise=proxy_noise)
            for target, ht in h.items():
                metrics = gradient_metrics(ht, truth[target][sets])
                bucket = per_set.setdefault((target, spec[0]), {})
                for metric, values in metrics.items():
                    bucket.setdefault(metric, []).append(values)
            if progress is not None:
                progress(spec[0])
    records = []
    for target in prob.targets:
        for spec in specs:
            bucket = per_set[(target, spec[0])]
            for metric in config["metrics"]:
                values = torch.cat(bucket[metric])
                finite = values[torch.isfinite(values)]  # non-finite values (bias_ratio = inf) are left out
                mean = float(finite.mean()) if finite.numel() else None
                std = float(finite.std(correction=1)) if finite.numel() > 1 else 0.0 if finite.numel() else None
                records.append({
                    "dataset": f"{family}/{case}", "family": family, "case": case, "loss": loss, "target": target,
                    "method": spec[0],
                    "estimator": spec[0], "registered_estimator": spec[1], "proxy_noise": spec[2] or "shared",
                    "metric": metric, "mean": mean, "std": std, "n_sets": S, "n_seeds": S,
                    "n_estimates": N, "n_finite": int(finite.numel()), "ground_truth_zero_sets": gt_zero[target],
                    "values": [float(v) if math.isfinite(v) else None for v in values.tolist()],
                })
    return records


