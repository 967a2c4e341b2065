"""Data of the ``synthetic`` study: settings, the estimators measured, and the random parameter sets."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hardeq import ConstrainedNormal, ConstrainedPoisson, LinearConstraint, SumConstraint
from hardeq.estimators import available_estimators

__all__ = ["CONFIG_PATH", "FAMILY_NAMES", "Problem", "estimator_specs", "gaussian_problem", "load_config",
           "order_key", "poisson_problem", "problem", "derived_seed", "seeded_generator"]

CONFIG_PATH = Path(__file__).resolve().parent / "config.json"
FAMILY_NAMES = {"gaussian": "Gaussian", "poisson": "Poisson"}
_ESTIMATOR_FAMILY = {"gaussian": "normal", "poisson": "poisson"}


def load_config(preset: str = "quick", *, n_sets: int | None = None, n_estimates: int | None = None,
                seed: int | None = None) -> dict:
    """The study's configuration for ``preset`` (``"quick"``, ``"cpu"`` or ``"paper"``), with overrides applied
    and the estimator lists resolved against the registry (so that a newly registered estimator is measured too)."""
    raw = json.loads(CONFIG_PATH.read_text())
    if preset not in raw["presets"]:
        raise ValueError(f"preset must be one of {sorted(raw['presets'])}, got {preset!r}.")
    config = {k: v for k, v in raw.items() if k not in ("presets", "summary", "extra", "default_preset")}
    config["preset"] = preset
    config.update({k: v for k, v in raw["presets"][preset].items() if k not in ("description", "duration")})
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
    return sorted(specs.values(), key=lambda s: order_key(s[0]))


_PREFERRED_ORDER = ["pathwise", "marginal_expectation", "constrained_marginal", "unconstrained_marginal",
                    "constrained_layer", "constrained_layer_independent", "constrained_reparam_independent",
                    "random"]


def order_key(name: str) -> tuple[int, str]:
    return (_PREFERRED_ORDER.index(name) if name in _PREFERRED_ORDER else len(_PREFERRED_ORDER) - 1, name)


def _import_family(family: str) -> None:
    if family == "poisson":
        import hardeq.estimators.poisson  # noqa: F401  (registers the Poisson estimators)
    elif family != "gaussian":
        raise ValueError(f"family must be 'gaussian' or 'poisson', got {family!r}.")


def derived_seed(seed: int, *keys: Any) -> int:
    digest = hashlib.sha256(json.dumps([seed, *[str(k) for k in keys]]).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def seeded_generator(seed: int, *keys: Any) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(seed, *keys))



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


def problem(config: dict, family: str, case: str, n_sets: int, seed: int) -> Problem:
    gen = seeded_generator(seed, family, case, "parameters")
    maker = gaussian_problem if family == "gaussian" else poisson_problem
    return maker(config, case, n_sets, gen)

