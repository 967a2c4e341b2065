r"""The ``vae-data`` study: VAEs whose *data* satisfy :math:`\sum_i x_i = 100` (MNIST rescaled by water-filling).

One unit = (model, variant, trial): train for the preset's epochs, then evaluate on the test set with
importance sampling. The variants differ only in the observation model built from the decoder's mean and
log-variance (:func:`observation`) and in the training objective (:func:`_reconstruction_loss`); they share the
initialisation and the data order of a trial. Two families, each with the three ways of meeting the constraint:

* likelihood-trained (``-log p(x|z) + KL``): ``unconstrained``, ``cl``, ``ours``;
* trained on a *sampled* squared error (``1/2 ||x~ - x||^2 + KL``, ``x~`` one reparameterised sample of the
  observation model): ``unconstrained-se``, ``cl-se``, ``ours-me`` (Marginal Expectation gradients, the paper's
  method), ``ours-pathwise``; and, with the observation variance frozen at its initial value
  (:data:`FROZEN_VARIANCE`), ``unconstrained-se-frozenvar`` and ``ours-pathwise-frozenvar``.

After every epoch a unit also records the test RL of its reconstructions on the first ``eval.curve_images`` test
images (one latent sample per image from a fixed generator, the same for every variant): the curve that shows
whether a gap between variants still moves.

Every variant whose density lives on :math:`\mathbb R^{784}` is also evaluated with its Gaussian conditioned on
the constraint at evaluation time (``<variant>+cond``), a density on the 783-dimensional plane like ``ours``.
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

__all__ = ["CONFIG_PATH", "VARIANTS", "LIKELIHOOD", "SAMPLED", "FROZEN_VARIANCE", "load_config", "settings",
           "pixel_sum_constraint", "cl_pixel", "cl_order", "observation", "on_plane", "training_loss", "model_epochs",
           "units_of", "run_unit", "evaluate", "reconstruction_rl", "run"]

CONFIG_PATH = Path(__file__).resolve().parent / "config.json"
#: variants trained on -log p(x | z)
LIKELIHOOD = ("unconstrained", "cl", "ours")
#: variants trained on the sampled squared error; value: the estimator of the conditioned sample (None: plain
#: reparameterisation of the unconstrained Gaussian)
SAMPLED = {"unconstrained-se": None, "cl-se": None, "ours-me": "marginal_expectation", "ours-pathwise": "pathwise",
           "unconstrained-se-frozenvar": None, "ours-pathwise-frozenvar": "pathwise"}
#: variants whose observation log-variance gets no gradient (its parameters keep their initial values: unit
#: variance for the homoscedastic observation), as Marginal Expectation leaves it. They isolate the variance effect:
#: with one shared variance the conditional mean does not depend on it, so ``ours-pathwise-frozenvar`` takes
#: Marginal Expectation's gradient for every other parameter, and ``unconstrained-se-frozenvar`` is the matched
#: baseline of ``ours-me`` with the variance handled the same way
FROZEN_VARIANCE = ("unconstrained-se-frozenvar", "ours-pathwise-frozenvar")
#: trained variants; ``<variant>+cond`` is an evaluation of a trained R^784 variant
VARIANTS = LIKELIHOOD + tuple(SAMPLED)
COND = "+cond"


def load_config(path: Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or CONFIG_PATH).read_text())


def settings(config: dict[str, Any], preset: str) -> dict[str, Any]:
    p = {k: v for k, v in config["presets"][preset].items() if k not in ("description", "duration")}
    return {**json.loads(json.dumps(config["protocol"])), **p}


def pixel_sum_constraint(total: float, n: int = 784) -> SumConstraint:
    """:math:`\\sum_i x_i = ` ``total`` over the ``n`` pixels (one group; O(n) conditioning)."""
    return SumConstraint(torch.zeros(n, dtype=torch.long), torch.tensor([float(total)]))


def cl_pixel(train_x: Tensor) -> int:
    """The Constraint Layer's dependent pixel, by a stated rule: the pixel with the largest variance over the
    training images ``(N, 784)`` (ties: the lowest index). A background pixel (variance ~0) would make CL's
    correction land where the data are always ~0; the most variable pixel is where a wrong sum is cheapest to
    absorb. O(N n)."""
    if train_x.dim() != 2 or train_x.shape[0] < 2:
        raise ValueError(f"train_x must be (N >= 2, n), got shape {tuple(train_x.shape)}.")
    return int(train_x.double().var(0).argmax())


def cl_order(pixel: int, n: int = 784) -> Tensor:
    """The variable ordering that makes ``pixel`` the Constraint Layer's dependent coordinate (the last)."""
    if not 0 <= int(pixel) < n:
        raise ValueError(f"pixel must be in [0, {n}), got {pixel}.")
    others = torch.cat([torch.arange(0, pixel), torch.arange(pixel + 1, n)])
    return torch.cat([others, torch.tensor([int(pixel)])])


def on_plane(variant: str) -> bool:
    """Whether ``variant``'s density lives on the plane (``ours*`` and every ``+cond`` evaluation)."""
    return variant.startswith("ours") or variant.endswith(COND)


def observation(variant: str, mean: Tensor, log_var: Tensor, constraint: SumConstraint,
                order: Tensor | None = None) -> Distribution:
    r""":math:`p(x\mid z)` of ``variant`` from the decoder's ``mean`` and ``log_var`` (``(*batch, 784)``):
    ``N(m', diag e^v)`` on :math:`\mathbb R^{784}`, conditioned on the constraint for :func:`on_plane` variants,
    with ``m' = CL(m)`` (the constraint layer solving for the last coordinate of ``order``) for ``cl*`` and
    ``m' = m`` otherwise. O(784) per image."""
    family = variant[: -len(COND)] if variant.endswith(COND) else variant
    if family not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} (optionally + {COND!r}), got {variant!r}.")
    if family.startswith("cl"):
        mean = constraint_layer(mean, constraint, order)
    scale = (0.5 * log_var).exp()
    if on_plane(variant):
        return ConstrainedNormal(mean, scale, constraint=constraint)
    return Independent(Normal(mean, scale), 1)


def _reconstruction_loss(variant: str, p: Distribution, x: Tensor, constraint: SumConstraint,
                         order: Tensor | None) -> Tensor:
    """The per-image training reconstruction term of ``variant``: ``-log p(x | z)`` for :data:`LIKELIHOOD`,
    ``1/2 ||x~ - x||^2`` of one sample ``x~`` for :data:`SAMPLED` (``cl-se``: the CL applied to the sample)."""
    if variant not in SAMPLED:
        return -p.log_prob(x)
    est = SAMPLED[variant]
    sample = p.rsample() if est is None else p.rsample(estimator=est)
    if variant == "cl-se":
        sample = constraint_layer(sample, constraint, order)
    return 0.5 * (sample - x).square().sum(-1)


def training_loss(variant: str, mean: Tensor, log_var: Tensor, x: Tensor, constraint: SumConstraint,
                  order: Tensor | None = None) -> Tensor:
    """The per-image reconstruction term ``variant`` trains on (the KL is added by the caller), from the decoder's
    ``mean`` and ``log_var`` ``(B, 784)``: :func:`_reconstruction_loss` of :func:`observation`, with the
    log-variance detached for :data:`FROZEN_VARIANCE` (its parameters then get no gradient and keep their
    initial values)."""
    if variant in FROZEN_VARIANCE:
        log_var = log_var.detach()
    return _reconstruction_loss(variant, observation(variant, mean, log_var, constraint, order), x, constraint, order)


def _build_model(name: str, s: dict[str, Any]):
    from .models import MODELS

    kw = {"hidden": tuple(s["hidden"])} if s.get("hidden") else {}
    return MODELS[name](observation=s.get("observation", "diagonal"), **kw)


@torch.no_grad()
def evaluate(model, variant: str, x: Tensor, constraint: SumConstraint, K: int, seed: int, chunk: int,
             tolerance: float, order: Tensor | None = None, keep: int = 10) -> dict[str, Any]:
    r"""Per-image test metrics, averaged, in two readings of the paper's likelihood:

    * ``ll``, ``elbo``: the model's own normalised density (learned variance, every constant included):
      importance-sampled :math:`\log\frac1K\sum_k p(x\mid z_k)p(z_k)/q(z_k\mid x)` and the mean of the same
      log-weights (nats);
    * ``ll_unit``, ``elbo_unit``: the same with :math:`\log p(x\mid z)` replaced by the unnormalised unit-variance
      Gaussian :math:`-\frac12\lVert x - \hat x(z)\rVert^2` of the reconstruction (what the paper's Table 2 values
      fit; independent of the learned variance, so every variant is comparable);

    and RL (squared error of the reconstruction :math:`\hat x`, the observation's mean, summed over pixels), the
    violation rate of the reconstructions (:math:`|\sum_i\hat x_i - 100| >` ``tolerance``; the first posterior
    sample's) and the first ``keep`` reconstructions (figures). Latent noise from its own generator, the same for
    every model. A variant on R^784 is also evaluated conditioned on the constraint (``<variant>+cond``).
    Cost: ``K`` decoder passes per image."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    names = [variant] + ([] if on_plane(variant) else [variant + COND])
    keys = ("ll", "elbo", "ll_unit", "elbo_unit", "rl")
    acc = {v: {**{k: [] for k in keys}, "sums": [], "max_dev": 0.0} for v in names}
    recon_keep = {}
    for xb in x.split(chunk):
        mean, log_var, log_ratio = model.importance(xb, K, generator=g)
        for v in names:
            p = observation(v, mean, log_var, constraint, order)
            recon = p.mean
            sq = (recon - xb).square().sum(-1)
            log_w, log_w_unit = p.log_prob(xb) + log_ratio, -0.5 * sq + log_ratio
            a = acc[v]
            a["ll"].append(importance_log_likelihood(log_w, dim=0))
            a["elbo"].append(log_w.mean(0))
            a["ll_unit"].append(importance_log_likelihood(log_w_unit, dim=0))
            a["elbo_unit"].append(log_w_unit.mean(0))
            a["rl"].append(sq.mean(0))
            sums = recon.to(torch.float64).sum(-1)
            a["sums"].append(sums[0])
            a["max_dev"] = max(a["max_dev"], float((sums - constraint.k.to(torch.float64)).abs().max()))
            if v not in recon_keep:
                recon_keep[v] = recon[0, :keep].clone()
    model.train()
    out = {}
    for v, a in acc.items():
        dev = (torch.cat(a["sums"]) - float(constraint.k)).abs()
        m = {k: float(torch.cat(a[k]).double().mean()) for k in keys}
        m.update(violation=float((dev > tolerance).double().mean()), violation_tol1=float((dev > 1.0).double().mean()),
                 max_sum_deviation=a["max_dev"])
        if not all(math.isfinite(m[k]) for k in keys):
            raise FloatingPointError(f"{v}: non-finite test metrics {m}")
        out[v] = {**m, "reconstructions": recon_keep[v]}
    return out


def run_unit(s: dict[str, Any], model_name: str, variant: str, trial: int, train_x: Tensor, test_x: Tensor,
             epochs: int, device: torch.device, progress: bool = False, order: Tensor | None = None
             ) -> dict[str, Any]:
    """Train one model with one variant and evaluate it (plain containers); ``order``: see :func:`cl_order`."""
    seed = int(s["seed_base"]) + trial
    constraint = pixel_sum_constraint(float(s["data"]["total"])).to(device)
    order = None if order is None else order.to(device)
    torch.manual_seed(seed)  # same initialisation for every variant of a model and trial
    model = _build_model(model_name, s).to(device)
    data_gen = torch.Generator().manual_seed(10_000 + seed)
    torch.manual_seed(20_000 + seed)  # latent noise during training

    def loss_per_item(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        mean, log_var, kl = model(batch["x"])
        return training_loss(variant, mean, log_var, batch["x"], constraint, order) + kl

    curve, epoch_s, curve_rl = [], [], []
    curve_x = test_x[: int(s["eval"].get("curve_images", 0))].to(device)

    def on_epoch(tr: Any, metrics: dict[str, Tensor]) -> None:
        epoch_s.append(time.perf_counter() - tr.epoch_started)
        curve.append(float(metrics["train_loss"][0]))
        if curve_x.shape[0]:
            curve_rl.append(reconstruction_rl(model, variant, curve_x, constraint, int(s["eval"]["seed"]) + 1,
                                    int(s["eval"]["chunk"]), order))
        if progress:
            rl = f", test RL {curve_rl[-1]:.2f}" if curve_rl else ""
            print(f"  {model_name:6s} {variant:14s} trial {trial} epoch {tr.epoch + 1}/{epochs}: train loss "
                  f"{curve[-1]:.2f}{rl} ({epoch_s[-1]:.1f} s)", flush=True)

    bs = int(s["train"]["batch_size"])
    train(model, Objective(loss_per_item), ShuffledBatches({"x": train_x}, bs, data_gen, device=device), None,
          TrainConfig(epochs, bs, zero_grad_to_none=True, raise_nonfinite=True), [seed],
          optimizer=lambda params: torch.optim.Adam(params, lr=float(s["train"]["lr"])), hooks=OnEpoch(on_epoch),
          progress=False, desc=f"{model_name}/{variant}/trial {trial}")
    t0 = time.perf_counter()
    metrics = evaluate(model, variant, test_x.to(device), constraint, int(s["importance_samples"]),
                       int(s["eval"]["seed"]), int(s["eval"]["chunk"]), float(s["data"]["violation_tolerance"]),
                       order)
    out = {"metrics": metrics, "curve_train_loss": curve, "epoch_seconds": epoch_s,
           "eval_seconds": time.perf_counter() - t0}
    return {**out, "curve_test_rl": curve_rl} if curve_rl else out


@torch.no_grad()
def reconstruction_rl(model, variant: str, x: Tensor, constraint: SumConstraint, seed: int, chunk: int,
            order: Tensor | None = None) -> float:
    """Mean RL (squared error of the reconstruction, the observation's mean, summed over pixels) of ``x`` with one
    latent sample per image drawn from a generator seeded ``seed`` (the same noise for every variant and epoch);
    in eval mode, restoring train mode. Cost: one decoder pass per image."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for xb in x.split(chunk):
        mean, log_var, _ = model.importance(xb, 1, generator=g)
        recon = observation(variant, mean, log_var, constraint, order).mean
        total += float((recon - xb).square().sum(-1).double().sum())
    model.train()
    return total / x.shape[0]


def model_epochs(s: dict[str, Any], model: str, epochs: int) -> int:
    """Epochs of ``model``'s units: the preset's ``model_epochs[model]`` when it names the model (a smaller budget
    for the costlier Ladder and Graph VAEs), else ``epochs`` (the run's)."""
    n = (s.get("model_epochs") or {}).get(model)
    if n is None:
        return int(epochs)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"model_epochs[{model!r}] must be a positive integer, got {n!r}.")
    return n


def units_of(s: dict[str, Any], models: list[str], variants: list[str], trials: list[int]) -> list[tuple]:
    """(model, variant, trial) of every unit: the sampled-squared-error variants only for the models the preset
    names. Trials outermost, so an interrupted run has whole trials."""
    sample_models = set(s.get("sample_variants_models", []))
    return [(m, v, t) for t in trials for m in models for v in variants if v not in SAMPLED or m in sample_models]


def run(s: dict[str, Any], trials: list[int], epochs: int, *, models: list[str] | None = None,
        variants: list[str] | None = None, checkpoint_path: Path | None = None, resume: bool = False,
        device: torch.device | None = None, progress: bool = True) -> dict[str, Any]:
    device = device or torch.device("cpu")
    models = list(models or s["models"])
    variants = list(variants or VARIANTS)
    total = float(s["data"]["total"])
    train_x, _ = brightness_mnist("train", total, limit=s.get("train_subset"))
    test_x, _ = brightness_mnist("test", total, limit=s.get("test_subset"))
    pixel = cl_pixel(train_x)
    order = cl_order(pixel, train_x.shape[-1])
    blocks = {f"{m}/{v}/{t}": (lambda m=m, v=v, t=t: run_unit(s, m, v, t, train_x, test_x, model_epochs(s, m, epochs),
                                                                device, progress, order))
              for m, v, t in units_of(s, models, variants, trials)}
    run_id = {"study": "vae-data", "settings": s, "epochs": epochs, "trials": trials, "models": models,
              "variants": variants}
    count = [0]

    def report(key: str, unit: dict[str, Any]) -> None:
        count[0] += 1
        if progress:
            parts = [f"{v}: LL {m['ll']:.1f}, ELBO {m['elbo']:.1f}, LL(unit) {m['ll_unit']:.1f}, RL {m['rl']:.2f}, "
                     f"viol {m['violation']:.2f}"
                     for v, m in unit["metrics"].items()]
            print(f"[{count[0]}/{len(blocks)}] {key}: " + "; ".join(parts), flush=True)

    units = run_blocks(blocks, checkpoint_path=checkpoint_path, resume=resume, run_id=run_id, on_block=report)
    return {"units": units, "models": models, "variants": variants, "trials": trials,
            "n_train": int(train_x.shape[0]), "n_test": int(test_x.shape[0]), "originals": test_x[:10].clone(),
            "cl_pixel": pixel, "cl_pixel_variance": float(train_x.double().var(0)[pixel]),
            "cl_pixel_mean": float(train_x.double().mean(0)[pixel])}
