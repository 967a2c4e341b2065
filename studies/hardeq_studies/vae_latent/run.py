r"""The ``vae-latent`` study: an MLP VAE on binarised MNIST whose latent satisfies :math:`Az = k` exactly.

One unit = (constraint, method, trial): train a VAE for the preset's epochs with the method's gradient
estimator for the reconstruction term (the KL to the prior on the same plane is differentiated in closed form),
then evaluate on the test set. Methods share the initialisation and the data order of a trial (paired), and
every evaluation uses the same noise (its own RNG stream), so differences between methods are the estimators'.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hardeq import LinearConstraint, SumConstraint
from hardeq.nn import ConstrainedGaussianLatent, importance_log_likelihood

from ..harness import Objective, OnEpoch, ShuffledBatches, TrainConfig, run_blocks, train
from ..images import load_mnist

__all__ = ["CONFIG_PATH", "load_config", "settings", "build_constraint", "VAE", "binarised_mnist", "run_unit",
           "evaluate", "run"]

CONFIG_PATH = Path(__file__).resolve().parent / "config.json"


def load_config(path: Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or CONFIG_PATH).read_text())


def settings(config: dict[str, Any], preset: str) -> dict[str, Any]:
    """The protocol with the preset's settings on top."""
    p = {k: v for k, v in config["presets"][preset].items() if k not in ("description", "duration")}
    return {**json.loads(json.dumps(config["protocol"])), **p}


def build_constraint(name: str, spec: dict[str, Any], latent: int) -> SumConstraint | LinearConstraint:
    """The latent constraint ``name`` of the config: ``sum`` (one group, total 0) or ``dense`` (fixed random A)."""
    if spec["kind"] == "sum":
        return SumConstraint(torch.zeros(latent, dtype=torch.long), torch.zeros(1))
    if spec["kind"] == "dense":
        g = torch.Generator().manual_seed(int(spec["seed"]))
        A = torch.randn(int(spec["rows"]), latent, generator=g)
        return LinearConstraint(A, torch.zeros(int(spec["rows"])))
    raise ValueError(f"constraint {name!r}: unknown kind {spec['kind']!r} (expected 'sum' or 'dense').")


class VAE(nn.Module):
    r"""The appendix-B VAE: encoder fc(784,512)-ReLU-fc(512,256)-ReLU and two fc(256, z) heads (mean,
    log-variance) in a :class:`~hardeq.nn.ConstrainedGaussianLatent`; decoder fc(z,256)-ReLU-fc(256,512)-ReLU-
    fc(512,784), Bernoulli logits. (The paper prints the heads as fc(512, z), which does not follow a 256-wide
    layer.)"""

    def __init__(self, latent: int, hidden: list[int], constraint: SumConstraint | LinearConstraint | None) -> None:
        super().__init__()
        h1, h2 = hidden
        self.encoder = nn.Sequential(nn.Linear(784, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU())
        self.latent = ConstrainedGaussianLatent(h2, latent, constraint)
        self.decoder = nn.Sequential(nn.Linear(latent, h2), nn.ReLU(), nn.Linear(h2, h1), nn.ReLU(),
                                     nn.Linear(h1, 784))

    def posterior(self, x: Tensor):
        return self.latent(self.encoder(x))

    def log_likelihood(self, x: Tensor, z: Tensor) -> Tensor:
        r""":math:`\log p(x\mid z)`, Bernoulli, summed over pixels: ``z (*s, B, n)``, ``x (B, 784)`` -> ``(*s, B)``."""
        logits = self.decoder(z)
        return -F.binary_cross_entropy_with_logits(logits, x.expand_as(logits), reduction="none").sum(-1)


def binarised_mnist(split: str, subset: int | None, seed: int) -> Tensor:
    """Grey levels in [0, 1] (training; binarised afresh each epoch) or one fixed binarisation (test)."""
    images, _ = load_mnist(split)
    x = images.reshape(-1, 784).to(torch.float32) / 255.0
    if subset:
        x = x[:subset]
    if split == "test":
        x = torch.bernoulli(x, generator=torch.Generator().manual_seed(seed))
    return x


def _sample(q, estimator: str, noise: Tensor | None = None) -> Tensor:
    if isinstance(q, torch.distributions.Independent):  # unconstrained reference
        eps = torch.randn_like(q.mean) if noise is None else noise
        return q.mean + q.stddev * eps
    sample_shape = () if noise is None else noise.shape[:noise.dim() - q.mean.dim()]
    return q.rsample(sample_shape, estimator=estimator, noise=noise)


@torch.no_grad()
def evaluate(model: VAE, x: Tensor, K: int, seed: int, chunk: int) -> dict[str, Any]:
    r"""Test metrics per image, averaged: importance-sampled NLL :math:`-\log\frac1K\sum_k w_k`, NELBO
    :math:`-\frac1K\sum_k\log p(x\mid z_k) + \mathrm{KL}` and reconstruction loss :math:`-\frac1K\sum_k
    \log p(x\mid z_k)`, with :math:`z_k` exact samples of the (constrained) posterior; also the largest
    constraint residual of every latent sample drawn and the mean marginal standard deviation of the posterior.
    Noise from its own generator (``seed``)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    nll, nelbo, rec, scale, residual = [], [], [], [], 0.0
    for xb in x.split(chunk):
        q = model.posterior(xb)
        prior = model.latent.prior(xb)
        eps = torch.randn((K,) + q.mean.shape, generator=g)
        z = _sample(q, "pathwise", eps)  # (K, B, n)
        if model.latent.constraint is not None:
            residual = max(residual, float(model.latent.constraint.residual(z).abs().max()))
        log_px = model.log_likelihood(xb, z)
        log_w = log_px + prior.log_prob(z) - q.log_prob(z)
        kl = model.latent.kl(q)
        scale.append(q.stddev.mean(-1))
        nll.append(-importance_log_likelihood(log_w, dim=0))
        rec.append(-log_px.mean(0))
        nelbo.append(-log_px.mean(0) + kl)
    model.train()
    cat = lambda v: torch.cat(v).to(torch.float64)  # noqa: E731
    out = {"nll": float(cat(nll).mean()), "nelbo": float(cat(nelbo).mean()), "rec": float(cat(rec).mean())}
    if not all(math.isfinite(v) for v in out.values()):
        raise FloatingPointError(f"non-finite test metrics {out}")
    return {**out, "max_latent_residual": residual, "posterior_std": float(cat(scale).mean())}


@torch.no_grad()
def _test_nelbo(model: VAE, x: Tensor, seed: int, chunk: int) -> float:
    """One-sample test NELBO (the training curves), common noise across methods."""
    return evaluate(model, x, 1, seed, chunk)["nelbo"]


def run_unit(s: dict[str, Any], constraint_name: str, method: str, trial: int, train_x: Tensor, test_x: Tensor,
             epochs: int, device: torch.device, progress: bool = False) -> dict[str, Any]:
    """Train one VAE and evaluate it; returns metrics, curves and timings (plain containers)."""
    latent = int(s["model"]["latent"])
    seed = int(s["seed_base"]) + trial
    constraint = None
    if method != "unconstrained":
        constraint = build_constraint(constraint_name, s["constraints"][constraint_name], latent)
    torch.manual_seed(seed)  # same initialisation for every method of a trial
    model = VAE(latent, list(s["model"]["hidden"]), constraint).to(device)
    data_gen = torch.Generator().manual_seed(10_000 + seed)  # same batches for every method
    torch.manual_seed(20_000 + seed)  # estimator-internal noise (independent proxies, random gradients)
    chunk = int(s["eval"]["chunk"])

    def loss_per_item(model: VAE, batch: dict[str, Tensor]) -> Tensor:
        q = model.posterior(batch["x"])
        return -model.log_likelihood(batch["x"], _sample(q, method)) + model.latent.kl(q)

    def binarise(data: dict[str, Tensor], gen: torch.Generator) -> dict[str, Tensor]:
        return {"x": torch.bernoulli(data["x"], generator=gen)}  # a fresh binarisation every epoch

    curve_train, curve_test, epoch_s = [], [], []

    def on_epoch(tr: Any, metrics: dict[str, Tensor]) -> None:
        epoch_s.append(time.perf_counter() - tr.epoch_started)
        curve_train.append(float(metrics["train_loss"][0]))
        curve_test.append(_test_nelbo(model, test_x.to(device), int(s["eval"]["seed"]) + 1, chunk))
        if progress:
            print(f"  {constraint_name:5s} {method:32s} trial {trial} epoch {tr.epoch + 1}/{epochs}: train NELBO "
                  f"{curve_train[-1]:.2f}, test NELBO {curve_test[-1]:.2f} ({epoch_s[-1]:.1f} s)", flush=True)

    bs = int(s["train"]["batch_size"])
    source = ShuffledBatches({"x": train_x}, bs, data_gen, redraw=binarise, device=device)
    t0 = time.perf_counter()
    try:
        train(model, Objective(loss_per_item), source, None,
              TrainConfig(epochs, bs, zero_grad_to_none=True, raise_nonfinite=True), [seed],
              optimizer=lambda params: torch.optim.Adam(params, lr=float(s["train"]["lr"])),
              hooks=OnEpoch(on_epoch), progress=False, desc=f"{constraint_name}/{method}/trial {trial}")
        t0 = time.perf_counter()
        metrics = evaluate(model, test_x.to(device), int(s["importance_samples"]), int(s["eval"]["seed"]), chunk)
    except FloatingPointError as err:  # a biased estimator can blow the posterior up: record it, go on
        if progress:
            print(f"  {constraint_name} {method} trial {trial}: diverged ({err})", flush=True)
        metrics = {**dict.fromkeys(("nll", "nelbo", "rec", "max_latent_residual", "posterior_std"), math.nan),
                   "diverged": str(err)}
        for curve in (curve_train, curve_test):
            curve.extend([math.nan] * (epochs - len(curve)))
    return {"metrics": metrics, "curve_train_nelbo": curve_train, "curve_test_nelbo": curve_test,
            "epoch_seconds": epoch_s, "eval_seconds": time.perf_counter() - t0}


def run(s: dict[str, Any], trials: list[int], epochs: int, *, methods: list[str] | None = None,
        constraints: list[str] | None = None, checkpoint_path: Path | None = None, resume: bool = False,
        device: torch.device | None = None, progress: bool = True) -> dict[str, Any]:
    """Every unit, checkpointed after each (``--resume`` skips the finished ones)."""
    device = device or torch.device("cpu")
    methods = list(methods or s["methods"])
    constraints = list(constraints or s["constraints_run"])
    train_x = binarised_mnist("train", s.get("train_subset"), 0)
    test_x = binarised_mnist("test", s.get("test_subset"), int(s["eval"]["seed"]))
    blocks = {}
    for c in constraints:
        for t in trials:
            for m in methods:
                if m == "unconstrained" and c != constraints[0]:
                    continue  # the unconstrained reference does not depend on the constraint: train it once
                blocks[f"{c}/{m}/{t}"] = (lambda c=c, m=m, t=t: run_unit(s, c, m, t, train_x, test_x, epochs, device,
                                                                         progress))
    run_id = {"study": "vae-latent", "settings": s, "epochs": epochs, "trials": trials, "methods": methods,
              "constraints": constraints}
    done = {}

    def report(key: str, unit: dict[str, Any]) -> None:
        done[key] = unit
        if progress:
            m = unit["metrics"]
            print(f"[{len(done)}/{len(blocks)}] {key}: NLL {m['nll']:.2f}, NELBO {m['nelbo']:.2f}, "
                  f"rec {m['rec']:.2f}", flush=True)

    units = run_blocks(blocks, checkpoint_path=checkpoint_path, resume=resume, run_id=run_id, on_block=report)
    return {"units": units, "methods": methods, "constraints": constraints, "trials": trials,
            "n_train": int(train_x.shape[0]), "n_test": int(test_x.shape[0])}
