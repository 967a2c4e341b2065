r"""Study ``synthetic``: how good is each gradient estimator? (Gaussian and Poisson, L1 and L2.)

Reproduces the source paper's synthetic comparison of gradient estimators (its figure comparing the
estimators for the L1 and L2 losses on Gaussian variables, and the Poisson counterpart of its appendix
"Beyond Gaussian"), with a protocol that is stated in full here and recorded with the results
(``configs/synthetic.json``, copied into ``OUT/synthetic.json``).

Protocol
--------
*Parameter sets.* ``n_sets`` independent sets (20 with ``--full``, 4 with ``--quick``; ``--seeds S``
overrides), all in float64:

* **Gaussian**, ``n = 10``, diagonal covariance: ``loc_i ~ N(0, 1)``, ``log_scale_i ~ U(log 1/2, log 2)``
  (``scale = exp(log_scale)``). Two constraint cases: ``sum`` -- one sum constraint ``1^T z = k``
  (:class:`hardeq.SumConstraint`); ``dense`` -- ``a = 3`` constraints with ``A_ij ~ N(0, 1)``
  (:class:`hardeq.LinearConstraint`). Target ``y ~ N(0, I_n)`` and ``k = A y``: ``y`` is then an exact
  draw of ``N(0, I)`` conditioned on ``A y = k`` (with ``k`` drawn from its marginal ``N(0, A A^T)``).
* **Poisson**, ``n = 10``: ``log_rate_i ~ N(0, 1)``, one sum constraint with the integer total ``k = 20``;
  target ``y ~ Multinomial(20, uniform)``, i.e. iid Poissons conditioned on ``sum(y) = 20``.

*Estimates.* For each set, ``N`` estimates (10,000 with ``--full``, 1,000 with ``--quick``;
``--estimates`` overrides) ``h_i = grad_theta l(z_i)``, ``z_i`` one exact sample and ``l`` the summed
L1 (``sum_j |z_j - y_j|``) or L2 (``sum_j (z_j - y_j)^2``) loss, differentiated through the estimator.
``torch.abs`` has derivative 0 at 0: it matters for the Poisson L1 loss, where ``z_j = y_j`` has
positive probability (the closed form's derivative is the derivative of the expectation, whatever
subgradient the samples use). All ``N`` estimates of all sets in a chunk come from **one batched call**:
the parameters are expanded to per-sample leaves of shape ``(sets, N, n)``, the distribution gets batch
shape ``(sets, N)``, one sample is drawn per batch element, the per-sample losses are summed and
differentiated once; row ``(s, i)`` of the leaves' gradient is ``h_i`` of set ``s``.

*Common random numbers.* Within a family and constraint case every estimator sees the same parameter
sets, the same forward samples (the same noise ``eps``: all estimators share the forward pass) and, for
the variants that need one, the same independent proxy noise ``eps'``; L1 and L2 use the same draws.
Differences between estimators are therefore paired, not sampling noise between runs. Every estimator
call starts by reseeding torch's global generator from ``(seed, family, case, chunk)``: the Poisson forward
samples (drawn there by ``ConstrainedPoisson.rsample``) are shared too, the ``random`` estimator draws its
noise there, and results do not depend on the order of the blocks (``--resume``).

*Estimators.* Gaussian: every estimator registered for the ``"normal"`` family
(:func:`hardeq.estimators.available_estimators`) -- ``pathwise``, ``marginal_expectation``,
``constrained_marginal``, ``unconstrained_marginal``, ``constrained_layer`` (the constraint layer applied
to the reparameterised unconstrained sample built from the *same* noise as the forward sample),
``constrained_reparam_independent`` (a pathwise Matheron proxy from *independent* noise ``eps'``),
``random`` -- plus ``constrained_layer_independent``: ``constrained_layer`` with ``proxy_noise = eps'``
(independent noise, as in the paper's table). Poisson: every estimator registered for ``"poisson"``
(``marginal_expectation``, ``constrained_marginal``, ``unconstrained_marginal``, ``random``).

*Gradient targets.* Gaussian: ``loc`` (w.r.t. the means only, ``d = n``) and ``loc+log_scale`` (w.r.t.
means and log-scales together, concatenated, ``d = 2n``); both come from the same backward pass.
Poisson: ``log_rate`` (``d = n``).

*Ground truth.* ``h_gt = grad_theta sum_j E l_j``, autograd of the closed-form expected loss
(``expected_l1`` / ``expected_l2``, summed over coordinates) of the same parameter set.

*Metrics* (``cos`` = cosine similarity; ``cos(u, v) = 0`` when ``u`` or ``v`` is exactly zero, so a zero
estimate counts as uninformative; the fraction of exactly-zero estimates is reported as ``zero_fraction``):

* ``bias = 1 - cos(mean_i h_i, h_gt)``;
* ``variance = var_i(1 - cos(h_i, mean_j h_j))`` (unbiased, ``N - 1`` in the denominator);
* ``average_error = mean_i(1 - cos(h_i, h_gt))``;
* ``bias_ratio = N ||mean_i h_i - h_gt||^2 / sum_j var_i(h_ij)``: a Monte Carlo test of unbiasedness.
  ``E||mean - h_gt||^2 = tr Cov(h) / N`` exactly when ``E h = h_gt``, so the ratio is about 1 for an unbiased
  estimator (a weighted chi-square over its mean: between 0 and a few) and grows like ``N`` for a biased
  one. The cosine ``bias`` of an *unbiased* estimator is not 0 but ``O(1/N)`` (Monte Carlo noise in the
  mean); this column tells the two apart. (0 / 0 -- a constant estimate equal to the truth -- counts as 0;
  a constant estimate different from it as ``inf``.)

Each metric is computed per parameter set; the records hold the mean and the standard deviation
(``N - 1`` denominator) over the sets, and the per-set values.

Caveat on the ``random`` reference: the direction of the mean of ``N`` isotropic random vectors is
uniform *for every* ``N``, so its ``bias`` stays ``1 +- 1/sqrt(d)`` per set (it does not shrink with ``N``);
only its ``average_error`` concentrates at 1 as ``N`` grows (``+- 1/sqrt(dN)``).

Outputs: ``OUT/synthetic.json`` (records keyed by ``family``, ``case``, ``loss``, ``target``,
``method``/``estimator``, ``metric`` with ``mean``, ``std``, ``n_sets``; DESIGN.md section 5),
``OUT/synthetic.md`` and one grouped bar chart per family and loss, ``OUT/synthetic_{family}_{loss}.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

import hardeq
from hardeq import ConstrainedNormal, ConstrainedPoisson, LinearConstraint, SumConstraint
from hardeq.estimators import available_estimators

from .results import atomic_write_text, markdown_table, write_json

__all__ = [
    "DESCRIPTION",
    "load_config",
    "estimator_specs",
    "cosine",
    "gradient_metrics",
    "gaussian_problem",
    "poisson_problem",
    "ground_truth",
    "estimates",
    "run_block",
    "run",
    "reproduce",
    "render_markdown",
    "plot",
]

DESCRIPTION = ("gradient estimators on synthetic problems: bias, variance, average error "
               "(Gaussian and Poisson, L1 and L2)")

CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "synthetic.json"
METRICS = ("bias", "variance", "average_error")  # the paper's three; the config adds diagnostics
LABELS = {"bias": "bias", "variance": "variance", "average_error": "average error",
          "bias_ratio": "bias ratio (≈1 iff unbiased)", "zero_fraction": "zero grads"}
FAMILY_NAMES = {"gaussian": "Gaussian", "poisson": "Poisson"}
_ESTIMATOR_FAMILY = {"gaussian": "normal", "poisson": "poisson"}


# ---------------------------------------------------------------------------------------------- config
def load_config(preset: str = "quick", *, n_sets: int | None = None, n_estimates: int | None = None,
                seed: int | None = None) -> dict:
    """The study's configuration for ``preset`` (``"quick"`` or ``"full"``), with overrides applied and the
    estimator lists resolved against the registry (so that a newly registered estimator is measured too)."""
    raw = json.loads(CONFIG_PATH.read_text())
    if preset not in raw["presets"]:
        raise ValueError(f"preset must be one of {sorted(raw['presets'])}, got {preset!r}.")
    config = {k: v for k, v in raw.items() if k != "presets"}
    config["preset"] = preset
    config.update(raw["presets"][preset])
    for key, value in (("n_sets", n_sets), ("n_estimates", n_estimates), ("seed", seed)):
        if value is not None:
            if key != "seed" and int(value) < 1:
                raise ValueError(f"{key} must be a positive integer, got {value}.")
            config[key] = int(value)
    if config["n_estimates"] < 2:
        raise ValueError(f"n_estimates must be at least 2 (a variance is measured), got {config['n_estimates']}.")
    for family in ("gaussian", "poisson"):
        config[family]["estimators"] = [name for name, _, _ in estimator_specs(family, config)]
    return config


def estimator_specs(family: str, config: dict) -> list[tuple[str, str, str | None]]:
    """``(name, registered estimator id, proxy noise)`` for every estimator measured in ``family``: all
    registered ones plus the config's variants (``proxy noise = "independent"`` passes ``proxy_noise = eps'``)."""
    _import_family(family)
    specs: dict[str, tuple[str, str, str | None]] = {
        name: (name, name, None) for name in available_estimators(_ESTIMATOR_FAMILY[family])
    }
    for name, variant in config[family].get("variants", {}).items():
        specs[name] = (name, variant["estimator"], variant.get("proxy_noise"))
    return sorted(specs.values(), key=lambda s: _order_key(s[0]))


_PREFERRED_ORDER = ["pathwise", "marginal_expectation", "constrained_marginal", "unconstrained_marginal",
                    "constrained_layer", "constrained_layer_independent", "constrained_reparam_independent",
                    "random"]


def _order_key(name: str) -> tuple[int, str]:
    return (_PREFERRED_ORDER.index(name) if name in _PREFERRED_ORDER else len(_PREFERRED_ORDER) - 1, name)


def _import_family(family: str) -> None:
    if family == "poisson":
        import hardeq.estimators.poisson  # noqa: F401  (registers the Poisson estimators)
    elif family != "gaussian":
        raise ValueError(f"family must be 'gaussian' or 'poisson', got {family!r}.")


def _derived_seed(seed: int, *keys: Any) -> int:
    digest = hashlib.sha256(json.dumps([seed, *[str(k) for k in keys]]).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _generator(seed: int, *keys: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_derived_seed(seed, *keys))


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


# -------------------------------------------------------------------------------------------- problems
@dataclass
class Problem:
    """The parameter sets of one family and constraint case (leading dimension: the set).

    ``params`` maps the gradient-target parameter names to ``(sets, n)`` tensors (``loc``, ``log_scale``
    for the Gaussian; ``log_rate`` for the Poisson); ``y`` is the target ``(sets, n)``; ``constraint_data``
    holds what :meth:`distribution` needs to rebuild the constraint for a slice of the sets.
    """

    family: str
    case: str
    params: dict[str, Tensor]
    y: Tensor
    constraint_data: dict[str, Tensor]
    targets: dict[str, tuple[str, ...]]

    @property
    def n_sets(self) -> int:
        return self.y.shape[0]

    def distribution(self, params: dict[str, Tensor], sets: slice, per_sample: bool):
        """The distribution for ``params`` (sets sliced with ``sets``; with ``per_sample``, ``params`` have
        shape ``(sets, N, n)`` and the constraint gets a broadcasting sample dimension)."""
        data = {k: v[sets] for k, v in self.constraint_data.items()}
        expand = (lambda t: t.unsqueeze(1)) if per_sample else (lambda t: t)
        if self.family == "gaussian":
            if "A" in data:
                constraint = LinearConstraint(expand(data["A"]), expand(data["k"]), validate_args=False)
            else:
                n = params["loc"].shape[-1]
                index = torch.zeros(n, dtype=torch.long)
                constraint = SumConstraint(index, expand(data["k"]), validate_args=False)
            return ConstrainedNormal(params["loc"], params["log_scale"].exp(), constraint=constraint)
        return ConstrainedPoisson(params["log_rate"].exp(), expand(data["total"]))


def gaussian_problem(config: dict, case: str, n_sets: int, generator: torch.Generator) -> Problem:
    """Draw ``n_sets`` Gaussian parameter sets for constraint case ``case`` (see the module docstring)."""
    cfg = config["gaussian"]
    n, dtype = cfg["n"], getattr(torch, config["dtype"])
    spec = cfg["cases"][case]
    lo, hi = cfg["log_scale_range"]
    loc = torch.randn(n_sets, n, generator=generator, dtype=dtype)
    log_scale = lo + (hi - lo) * torch.rand(n_sets, n, generator=generator, dtype=dtype)
    y = torch.randn(n_sets, n, generator=generator, dtype=dtype)
    if spec["constraint"] == "sum":
        data = {"k": y.sum(-1, keepdim=True)}
    elif spec["constraint"] == "dense":
        A = torch.randn(n_sets, spec["a"], n, generator=generator, dtype=dtype)
        data = {"A": A, "k": (A @ y.unsqueeze(-1)).squeeze(-1)}
    else:
        raise ValueError(f"unknown constraint kind {spec['constraint']!r} in case {case!r}.")
    targets = {"loc": ("loc",), "loc+log_scale": ("loc", "log_scale")}
    targets = {t: targets[t] for t in cfg["targets"]}
    return Problem("gaussian", case, {"loc": loc, "log_scale": log_scale}, y, data, targets)


def poisson_problem(config: dict, case: str, n_sets: int, generator: torch.Generator) -> Problem:
    """Draw ``n_sets`` Poisson parameter sets (one sum constraint with an integer total)."""
    cfg = config["poisson"]
    n, dtype, total = cfg["n"], getattr(torch, config["dtype"]), int(cfg["total"])
    if cfg["cases"][case]["constraint"] != "sum":
        raise ValueError(f"the Poisson study supports sum constraints only, got case {case!r}.")
    log_rate = torch.randn(n_sets, n, generator=generator, dtype=dtype)
    cells = torch.multinomial(torch.full((n,), 1.0 / n, dtype=dtype), total * n_sets, replacement=True,
                              generator=generator).reshape(n_sets, total)
    y = torch.zeros(n_sets, n, dtype=dtype).scatter_add_(1, cells, torch.ones(n_sets, total, dtype=dtype))
    data = {"total": torch.full((n_sets,), float(total), dtype=dtype)}  # one total per set: shape (sets,)
    return Problem("poisson", case, {"log_rate": log_rate}, y, data, {"log_rate": ("log_rate",)})


def _problem(config: dict, family: str, case: str, n_sets: int, seed: int) -> Problem:
    generator = _generator(seed, family, case, "parameters")
    maker = gaussian_problem if family == "gaussian" else poisson_problem
    return maker(config, case, n_sets, generator)


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


# ------------------------------------------------------------------------------------------------- run
def _blocks(config: dict) -> list[tuple[str, str, str]]:
    return [(family, case, loss) for family in ("gaussian", "poisson")
            for case in config[family]["cases"] for loss in config[family]["losses"]]


def _block_key(block: tuple[str, str, str]) -> str:
    return "/".join(block)


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
    problem = _problem(config, family, case, S, seed)
    truth = ground_truth(problem, loss)
    gt_zero = {t: int((torch.linalg.vector_norm(g, dim=-1) == 0).sum()) for t, g in truth.items()}
    noise_gen = _generator(seed, family, case, "noise")
    specs = estimator_specs(family, config)
    per_set: dict[tuple[str, str], dict[str, list[Tensor]]] = {}
    for start in range(0, S, chunk):
        sets = slice(start, min(S, start + chunk))
        s = sets.stop - sets.start
        noise = proxy_noise = None
        if family == "gaussian":
            n = config["gaussian"]["n"]
            noise = torch.randn(s, N, n, generator=noise_gen, dtype=problem.y.dtype)
            proxy_noise = torch.randn(s, N, n, generator=noise_gen, dtype=problem.y.dtype)
        for spec in specs:
            # Same global-generator state for every estimator and loss: the Poisson forward sample (drawn
            # from it by rsample) is then shared too; `random` draws its noise after the sample.
            torch.manual_seed(_derived_seed(seed, family, case, "estimates", start))
            h = estimates(problem, loss, spec, N, sets, noise=noise, proxy_noise=proxy_noise)
            for target, ht in h.items():
                metrics = gradient_metrics(ht, truth[target][sets])
                bucket = per_set.setdefault((target, spec[0]), {})
                for metric, values in metrics.items():
                    bucket.setdefault(metric, []).append(values)
            if progress is not None:
                progress(spec[0])
    records = []
    for target in problem.targets:
        for spec in specs:
            bucket = per_set[(target, spec[0])]
            for metric in config["metrics"]:
                values = torch.cat(bucket[metric])
                finite = values[torch.isfinite(values)]  # non-finite values (bias_ratio = inf) are left out
                mean = float(finite.mean()) if finite.numel() else None
                std = float(finite.std(correction=1)) if finite.numel() > 1 else 0.0 if finite.numel() else None
                records.append({
                    "family": family, "case": case, "loss": loss, "target": target, "method": spec[0],
                    "estimator": spec[0], "registered_estimator": spec[1], "proxy_noise": spec[2] or "shared",
                    "metric": metric, "mean": mean, "std": std, "n_sets": S,
                    "n_estimates": N, "n_finite": int(finite.numel()), "ground_truth_zero_sets": gt_zero[target],
                    "values": [float(v) if math.isfinite(v) else None for v in values.tolist()],
                })
    return records


def run(config: dict, seed: int | None = None, *, done: dict[str, list[dict]] | None = None,
        on_block: Callable[[str, list[dict]], None] | None = None,
        progress: Callable[[str], None] | None = None) -> list[dict]:
    """All records of the study (prints nothing). ``done`` maps block keys to records already computed
    (``--resume``); ``on_block(key, records)`` is called after each newly computed block."""
    done = {} if done is None else done
    records: list[dict] = []
    for block in _blocks(config):
        key = _block_key(block)
        if key not in done:
            done[key] = run_block(config, *block, seed=seed, progress=progress)
            if on_block is not None:
                on_block(key, done[key])
        records.extend(done[key])
    return records


# ------------------------------------------------------------------------------------------- rendering
def _fmt(record: dict) -> str:
    if record["mean"] is None:
        return "inf"
    text = f"{record['mean']:.3g} ± {record['std']:.2g}"
    if record.get("n_finite", record["n_sets"]) < record["n_sets"]:
        text += f" ({record['n_sets'] - record['n_finite']} inf)"
    return text


def _index(records: list[dict]) -> dict[tuple, dict]:
    return {(r["family"], r["case"], r["loss"], r["target"], r["method"], r["metric"]): r for r in records}


def _groups(records: list[dict]) -> list[tuple[str, str, str, str]]:
    seen: dict[tuple[str, str, str, str], None] = {}
    for r in records:
        seen.setdefault((r["family"], r["case"], r["loss"], r["target"]), None)
    return list(seen)


def _methods(records: list[dict], group: tuple) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        if (r["family"], r["case"], r["loss"], r["target"]) == group:
            seen.setdefault(r["method"], None)
    return sorted(seen, key=_order_key)


def render_markdown(doc: dict, command: str | None = None) -> str:
    """``synthetic.md``: protocol summary, one table per family and constraint case, the winners."""
    cfg, records = doc["config"], doc["records"]
    idx = _index(records)
    metrics = [m for m in ("bias", "variance", "average_error", "bias_ratio", "zero_fraction") if m in cfg["metrics"]]
    lines = ["# Study `synthetic`: gradient estimators on synthetic problems", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    env = doc.get("environment", {})
    timing = doc.get("timing", {})
    lines += [
        f"Preset `{doc['preset']}`: {cfg['n_sets']} parameter sets x {cfg['n_estimates']} estimates per set, "
        f"{cfg['dtype']}, seed {cfg['seed']}. torch {env.get('torch', '?')}, {env.get('device', '?')}, "
        f"{env.get('threads', '?')} threads, git {env.get('git', '?')}"
        + (f"; wall time {timing['total_s']:.0f} s." if "total_s" in timing else "."),
        "",
        "Cells: mean ± std over the parameter sets. `bias` = 1 - cos(mean_i h_i, h_gt); `variance` = "
        "var_i(1 - cos(h_i, mean_j h_j)); `average error` = mean_i(1 - cos(h_i, h_gt)); `bias ratio` = "
        "N ‖mean_i h_i - h_gt‖² / tr Cov(h), a Monte Carlo test of unbiasedness (≈ 1 for an unbiased "
        "estimator, grows like N for a biased one); `zero grads` = fraction of estimates that are exactly 0. "
        "Targets: `loc` = gradient w.r.t. the means only, `loc+log_scale` = w.r.t. means and log-scales "
        "together, `log_rate` = w.r.t. the Poisson log-rates. Protocol: `hardeq.experiments.synthetic` "
        "docstring; the exact config is in `synthetic.json`.",
        "",
        "Paper's claim (its figure and appendix \"Beyond Gaussian\"): Marginal Expectation is the best "
        "estimator in every case; Constrained Marginal and Unconstrained Marginal are about as bad as Random.",
        "",
    ]
    families = {}
    for group in _groups(records):
        families.setdefault((group[0], group[1]), []).append(group)
    for (family, case), groups in families.items():
        spec = cfg[family]["cases"][case]
        lines += [f"## {FAMILY_NAMES.get(family, family)}, `{case}` constraint (a = {spec.get('a', 1)}, "
                  f"n = {cfg[family]['n']})", ""]
        rows = []
        for group in groups:
            for method in _methods(records, group):
                row = [group[2].upper(), group[3], method]
                for metric in metrics:
                    r = idx.get(group + (method, metric))
                    row.append("" if r is None else _fmt(r))
                rows.append(row)
        lines.append(markdown_table(["loss", "target", "estimator"] + [LABELS[m] for m in metrics], rows))
    lines += ["## Best estimator per setting", "",
              "Lowest mean over the sets (ties within 1e-12 are listed together).", ""]
    rows = []
    for group in _groups(records):
        row = [FAMILY_NAMES.get(group[0], group[0]), group[1], group[2].upper(), group[3]]
        for metric in METRICS:
            vals = {m: idx[group + (m, metric)]["mean"] for m in _methods(records, group)
                    if group + (m, metric) in idx}
            best = min(vals.values())
            row.append(", ".join(m for m, v in vals.items() if v <= best + 1e-12))
        rows.append(row)
    lines.append(markdown_table(["family", "case", "loss", "target"] + [f"lowest {LABELS[m]}" for m in METRICS], rows))
    if doc.get("figures"):
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in doc["figures"]] + [""]
    return "\n".join(lines)


def plot(doc: dict, out: Path) -> list[Path]:
    """One grouped bar chart per family and loss (``OUT/synthetic_{family}_{loss}.png``): one row per
    constraint case and gradient target; groups = the three metrics, bars = estimators, error bars = std
    over the parameter sets; log scale (bias and variance span several decades)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    records = doc["records"]
    idx = _index(records)
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(_PREFERRED_ORDER)}
    paths = []
    by_family_loss: dict[tuple[str, str], list[tuple]] = {}
    for group in _groups(records):
        by_family_loss.setdefault((group[0], group[2]), []).append(group)
    for (family, loss), groups in by_family_loss.items():
        fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.9 * len(groups) + 1.4), squeeze=False)
        handles: dict[str, Any] = {}
        for ax, group in zip(axes[:, 0], groups):
            methods = _methods(records, group)
            width = 0.8 / len(methods)
            positive = [idx[group + (m, k)]["mean"] for m in methods for k in METRICS]
            positive = [v for v in positive if v is not None and v > 0]
            floor = 10 ** math.floor(math.log10(min(positive) / 2)) if positive else 1e-6
            for j, method in enumerate(methods):
                means = [idx[group + (method, m)]["mean"] for m in METRICS]
                stds = [idx[group + (method, m)]["std"] for m in METRICS]
                lower = [min(s, mu - floor) if mu > floor else 0.0 for mu, s in zip(means, stds)]
                xs = [i - 0.4 + width * (j + 0.5) for i in range(len(METRICS))]
                handles[method] = ax.bar(xs, [mu - floor for mu in means], width, bottom=floor,
                                         yerr=[lower, stds], capsize=2, label=method, color=colors.get(method),
                                         error_kw={"elinewidth": 0.8})
            ax.set_yscale("log")
            ax.set_ylim(bottom=floor)
            ax.set_xticks(range(len(METRICS)), [LABELS[m] for m in METRICS])
            ax.set_title(f"{group[1]} constraint, gradient w.r.t. {group[3]}", fontsize=10)
            ax.grid(axis="y", alpha=0.3, which="both")
        fig.suptitle(f"Gradient estimators, {FAMILY_NAMES.get(family, family)}, {loss.upper()} loss: "
                     f"{doc['config']['n_sets']} sets x {doc['config']['n_estimates']} estimates, "
                     f"mean ± std over sets (log scale; lower is better)", fontsize=11)
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8, frameon=False)
        height = fig.get_figheight()  # fixed margins in inches (tight_layout costs seconds per figure)
        fig.subplots_adjust(left=0.08, right=0.98, top=1 - 0.8 / height, bottom=0.85 / height, hspace=0.45)
        fig._suptitle.set_y(1 - 0.25 / height)
        path = Path(out) / f"synthetic_{family}_{loss}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--estimates", type=int, default=None,
                        help="estimates per parameter set (default: the preset's, 1000 quick / 10000 full)")
    parser.epilog = ("--seeds sets the number of random parameter sets (default 4 quick / 20 full); "
                     "--epochs is not used by this study.")


def _command(args: argparse.Namespace) -> str:
    parts = ["hardeq reproduce synthetic", f"--{getattr(args, 'preset', 'quick')}"]
    if getattr(args, "seeds", None) is not None:
        parts.append(f"--seeds {args.seeds}")
    if getattr(args, "estimates", None) is not None:
        parts.append(f"--estimates {args.estimates}")
    parts.append(f"--out {getattr(args, 'out', Path('results'))}")
    return " ".join(parts)


def reproduce(args: argparse.Namespace) -> dict:
    """Run the study with the CLI's arguments, print the tables, write ``OUT/synthetic.{json,md}`` and the
    bar charts. ``--resume`` continues from ``OUT/.synthetic.checkpoint.json`` if its config matches."""
    preset = getattr(args, "preset", None) or "quick"
    out = Path(getattr(args, "out", None) or "results")
    config = load_config(preset, n_sets=getattr(args, "seeds", None), n_estimates=getattr(args, "estimates", None))
    checkpoint = out / ".synthetic.checkpoint.json"
    done: dict[str, list[dict]] = {}
    timing: dict[str, Any] = {"blocks_s": {}}
    if getattr(args, "resume", False) and checkpoint.exists():
        state = json.loads(checkpoint.read_text())
        if state.get("config") == config:
            done, timing = state["blocks"], state.get("timing", timing)
        else:
            print(f"[synthetic] checkpoint {checkpoint} has another config; starting afresh.")

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    n_calls = sum(len(config[f]["estimators"]) * len(config[f]["cases"]) * len(config[f]["losses"])
                  for f in ("gaussian", "poisson"))
    n_chunks = math.ceil(config["n_sets"] / max(1, int(config.get("sets_per_chunk", config["n_sets"]))))
    bar = None if tqdm is None else tqdm(total=n_calls * n_chunks, desc="synthetic", unit="call", disable=None)
    if bar is not None:
        done_calls = sum(len(config[k.split("/")[0]]["estimators"]) for k in done) * n_chunks
        bar.update(done_calls)
    t_block = [time.perf_counter()]

    def on_block(key: str, block_records: list[dict]) -> None:
        now = time.perf_counter()
        timing["blocks_s"][key] = now - t_block[0]
        t_block[0] = now
        atomic_write_text(checkpoint, json.dumps({"config": config, "blocks": done, "timing": timing}) + "\n")

    records = run(config, done=done, on_block=on_block,
                  progress=None if bar is None else (lambda _name: bar.update(1)))
    if bar is not None:
        bar.close()
    timing["total_s"] = float(sum(timing["blocks_s"].values()))
    out.mkdir(parents=True, exist_ok=True)
    doc = {"study": "synthetic", "preset": preset, "config": config, "records": records, "timing": timing}
    doc["figures"] = [str(p.name) for p in plot(doc, out)]
    command = _command(args)
    doc = write_json(out / "synthetic.json", "synthetic", preset, config, records, timing=timing,
                     figures=doc["figures"], command=command, hardeq_version=hardeq.__version__)
    text = render_markdown(doc, command=command)
    atomic_write_text(out / "synthetic.md", text)
    if checkpoint.exists():
        checkpoint.unlink()
    print(text)
    return doc
