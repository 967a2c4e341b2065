r"""The ``vae-data`` study: VAEs whose *data* satisfy :math:`\sum_i x_i = 100` (MNIST rescaled by water-filling).

One unit = (model, variant, trial): train for the preset's epochs, then evaluate on the test set with
importance sampling. The variants differ only in the observation model built from the decoder's mean and
log-variance (:func:`observation`); they share the initialisation and the data order of a trial. The
unconstrained model is evaluated twice: as trained, and with its Gaussian conditioned on the constraint at
evaluation time (``unconstrained+cond``), the like-for-like comparison with ``ours`` (both are densities on the
783-dimensional plane; the others are densities on :math:`\mathbb R^{784}`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, Independent, Normal

from hardeq import ConstrainedNormal, SumConstraint
from hardeq.baselines import constraint_layer
from hardeq.nn import importance_log_likelihood

from ..harness import Objective, OnEpoch, ShuffledBatches, TrainConfig, run_blocks, train
from ..images import brightness_mnist

__all__ = ["CONFIG_PATH", "VARIANTS", "load_config", "settings", "pixel_sum_constraint", "observation",
           "units_of", "run_unit", "evaluate", "run"]

CONFIG_PATH = Path(__file__).resolve().parent / "config.json"
#: trained variants; ``unconstrained+cond`` is an evaluation of the ``unconstrained`` model
VARIANTS = ("unconstrained", "cl", "ours", "ours-me", "ours-pathwise")
#: variants whose density lives on the plane sum x = total
ON_PLANE = ("ours", "ours-me", "ours-pathwise", "unconstrained+cond")


def load_config(path: Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or CONFIG_PATH).read_text())


def settings(config: dict[str, Any], preset: str) -> dict[str, Any]:
    p = {k: v for k, v in config["presets"][preset].items() if k not in ("description", "duration")}
    return {**json.loads(json.dumps(config["protocol"])), **p}


def pixel_sum_constraint(total: float, n: int = 784) -> SumConstraint:
    """:math:`\\sum_i x_i = ` ``total`` over the ``n`` pixels (one group; O(n) conditioning)."""
    return SumConstraint(torch.zeros(n, dtype=torch.long), torch.tensor([float(total)]))


def observation(variant: str, mean: Tensor, log_var: Tensor, constraint: SumConstraint) -> Distribution:
    r""":math:`p(x\mid z)` of ``variant`` from the decoder's ``mean`` and ``log_var`` (``(*batch, 784)``)."""
    scale = (0.5 * log_var).exp()
    if variant == "unconstrained":
        return Independent(Normal(mean, scale), 1)
    if variant == "cl":
        return Independent(Normal(constraint_layer(mean, constraint), scale), 1)
    if variant in ON_PLANE:
        return ConstrainedNormal(mean, scale, constraint=constraint)
    raise ValueError(f"variant must be one of {VARIANTS + ('unconstrained+cond',)}, got {variant!r}.")


def _reconstruction_loss(variant: str, p: Distribution, x: Tensor) -> Tensor:
    """The per-image training reconstruction term of ``variant``."""
    if variant in ("ours-me", "ours-pathwise"):
        est = "marginal_expectation" if variant == "ours-me" else "pathwise"
        return 0.5 * (p.rsample(estimator=est) - x).square().sum(-1)
    return -p.log_prob(x)


def _build_model(name: str, s: dict[str, Any]):
    from .models import MODELS

    return MODELS[name](**({"hidden": tuple(s["hidden"])} if s.get("hidden") else {}))


@torch.no_grad()
def evaluate(model, variant: str, x: Tensor, constraint: SumConstraint, K: int, seed: int, chunk: int,
             tolerance: float, keep: int = 10) -> dict[str, Any]:
    r"""Per-image test metrics, averaged: importance-sampled LL :math:`\log\frac1K\sum_k p(x\mid z_k)p(z_k)/q(z_k\mid
    x)`, ELBO (the mean of the same log-weights), RL (squared error of the reconstruction, the observation's mean,
    summed over pixels), the violation rate of the reconstructions (:math:`|\sum_i\hat x_i - 100| >` ``tolerance``;
    the first posterior sample's), and the first ``keep`` reconstructions (for the figures). Latent noise from its
    own generator, the same for every model. For ``unconstrained`` also the conditioned-at-evaluation metrics."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    names = [variant] + (["unconstrained+cond"] if variant == "unconstrained" else [])
    acc = {v: {"ll": [], "elbo": [], "rl": [], "sums": [], "max_dev": 0.0} for v in names}
    recon_keep = {}
    for xb in x.split(chunk):
        mean, log_var, log_ratio = model.importance(xb, K, generator=g)
        for v in names:
            p = observation(v, mean, log_var, constraint)
            log_w = p.log_prob(xb) + log_ratio
            recon = p.mean
            a = acc[v]
            a["ll"].append(importance_log_likelihood(log_w, dim=0))
            a["elbo"].append(log_w.mean(0))
            a["rl"].append((recon - xb).square().sum(-1).mean(0))
            sums = recon.to(torch.float64).sum(-1)
            a["sums"].append(sums[0])
            a["max_dev"] = max(a["max_dev"], float((sums - constraint.k.to(torch.float64)).abs().max()))
            if v not in recon_keep:
                recon_keep[v] = recon[0, :keep].clone()
    model.train()
    out = {}
    for v, a in acc.items():
        dev = (torch.cat(a["sums"]) - float(constraint.k)).abs()
        m = {"ll": float(torch.cat(a["ll"]).double().mean()), "elbo": float(torch.cat(a["elbo"]).double().mean()),
             "rl": float(torch.cat(a["rl"]).double().mean()), "violation": float((dev > tolerance).double().mean()),
             "violation_tol1": float((dev > 1.0).double().mean()), "max_sum_deviation": a["max_dev"]}
        if not all(math.isfinite(m[k]) for k in ("ll", "elbo", "rl")):
            raise FloatingPointError(f"{v}: non-finite test metrics {m}")
        out[v] = {**m, "reconstructions": recon_keep[v]}
    return out


def run_unit(s: dict[str, Any], model_name: str, variant: str, trial: int, train_x: Tensor, test_x: Tensor,
             epochs: int, device: torch.device, progress: bool = False) -> dict[str, Any]:
    """Train one model with one observation variant and evaluate it (plain containers)."""
    seed = int(s["seed_base"]) + trial
    constraint = pixel_sum_constraint(float(s["data"]["total"])).to(device)
    torch.manual_seed(seed)  # same initialisation for every variant of a model and trial
    model = _build_model(model_name, s).to(device)
    data_gen = torch.Generator().manual_seed(10_000 + seed)
    torch.manual_seed(20_000 + seed)  # latent noise during training

    def loss_per_item(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        mean, log_var, kl = model(batch["x"])
        return _reconstruction_loss(variant, observation(variant, mean, log_var, constraint), batch["x"]) + kl

    curve, epoch_s = [], []

    def on_epoch(tr: Any, metrics: dict[str, Tensor]) -> None:
        epoch_s.append(time.perf_counter() - tr.epoch_started)
        curve.append(float(metrics["train_loss"][0]))
        if progress:
            print(f"  {model_name:6s} {variant:14s} trial {trial} epoch {tr.epoch + 1}/{epochs}: train loss "
                  f"{curve[-1]:.2f} ({epoch_s[-1]:.1f} s)", flush=True)

    bs = int(s["train"]["batch_size"])
    train(model, Objective(loss_per_item), ShuffledBatches({"x": train_x}, bs, data_gen, device=device), None,
          TrainConfig(epochs, bs, zero_grad_to_none=True, raise_nonfinite=True), [seed],
          optimizer=lambda params: torch.optim.Adam(params, lr=float(s["train"]["lr"])), hooks=OnEpoch(on_epoch),
          progress=False, desc=f"{model_name}/{variant}/trial {trial}")
    t0 = time.perf_counter()
    metrics = evaluate(model, variant, test_x.to(device), constraint, int(s["importance_samples"]),
                       int(s["eval"]["seed"]), int(s["eval"]["chunk"]), float(s["data"]["violation_tolerance"]))
    return {"metrics": metrics, "curve_train_loss": curve, "epoch_seconds": epoch_s,
            "eval_seconds": time.perf_counter() - t0}


def units_of(s: dict[str, Any], models: list[str], variants: list[str], trials: list[int]) -> list[tuple]:
    """(model, variant, trial) of every unit: the sampled-reconstruction variants only for the models the preset
    names. Trials outermost, so an interrupted run has whole trials."""
    sample_models = set(s.get("sample_variants_models", []))
    return [(m, v, t) for t in trials for m in models for v in variants
            if v not in ("ours-me", "ours-pathwise") or m in sample_models]


def run(s: dict[str, Any], trials: list[int], epochs: int, *, models: list[str] | None = None,
        variants: list[str] | None = None, checkpoint_path: Path | None = None, resume: bool = False,
        device: torch.device | None = None, progress: bool = True) -> dict[str, Any]:
    device = device or torch.device("cpu")
    models = list(models or s["models"])
    variants = list(variants or VARIANTS)
    total = float(s["data"]["total"])
    train_x, _ = brightness_mnist("train", total, limit=s.get("train_subset"))
    test_x, _ = brightness_mnist("test", total, limit=s.get("test_subset"))
    blocks = {f"{m}/{v}/{t}": (lambda m=m, v=v, t=t: run_unit(s, m, v, t, train_x, test_x, epochs, device, progress))
              for m, v, t in units_of(s, models, variants, trials)}
    run_id = {"study": "vae-data", "settings": s, "epochs": epochs, "trials": trials, "models": models,
              "variants": variants}
    count = [0]

    def report(key: str, unit: dict[str, Any]) -> None:
        count[0] += 1
        if progress:
            parts = [f"{v}: LL {m['ll']:.1f}, ELBO {m['elbo']:.1f}, RL {m['rl']:.2f}, viol {m['violation']:.2f}"
                     for v, m in unit["metrics"].items()]
            print(f"[{count[0]}/{len(blocks)}] {key}: " + "; ".join(parts), flush=True)

    units = run_blocks(blocks, checkpoint_path=checkpoint_path, resume=resume, run_id=run_id, on_block=report)
    return {"units": units, "models": models, "variants": variants, "trials": trials,
            "n_train": int(train_x.shape[0]), "n_test": int(test_x.shape[0]), "originals": test_x[:10].clone()}
