r"""Study ``chemical``: neural surrogates of chemical processes that must respect mass balances.

Three Aspen data sets (CSTR, a DME/DEE plant, a distillation train; ``hardeq/data/chemical_process``) map
process inputs ``x`` to outputs ``y`` that satisfy linear balances :math:`B y = b - A x` exactly. Every
method is the same MLP (2 x 32 ReLU) trained with Adam; they differ in how the output is produced:

============  ==========================================================================================
NN            unconstrained MLP, MSE loss
PINN          MSE + soft penalty :math:`w \cdot \mathrm{mean}_j (B\hat y - k)_j^2` (``penalty_loss``, w = 1)
KKT-hPINN     orthogonal projection of the MLP output onto :math:`\{By = k\}` (``KKTProjection``), MSE
ECNN          MLP predicts the ``n - a`` independent outputs, the dependent ones are solved
              (``EqualityCompletion.complete``), MSE
CL            constraint layer (``ConstraintLayer``): each balance solved for its variable with the largest
              scaled coefficient, MSE
CL-coord      extra: the same layer with its default (coordinate) variable order
ours          MLP outputs a mean and a log-variance per output; ``ConstrainedNormal`` conditioned on
              ``LinearConstraint(B, b - A x)``; closed-form expected L2 loss; prediction = conditional mean
ours-L1       the same with the closed-form expected L1 loss
ours-NLL      the same trained by the negative log-density of the target on the constraint plane
ours-sg       extra: ours with the log-variance head on stop-gradient features (see docs/chemical.md)
ours-NLL-sg   extra: ours-NLL with the log-variance head on stop-gradient features
============  ==========================================================================================

Protocol (the KKT-hPINN reference code's): every column MaxAbs-scaled on the whole file, constraint
coefficients rescaled so the balances hold exactly in scaled units, split in file order 60/20/20, batch 16,
lr 1e-4, 1000 epochs, 10 seeds; each seed's epoch with the lowest validation MSE is evaluated on the test
set. Settings live in ``configs/chemical.json``; ``docs/chemical.md`` discusses every choice.

All seeds *and* all methods of a data set train at once as one :class:`~hardeq.experiments.harness.BatchedMLP`
(members ordered method-major); see :mod:`hardeq.experiments.harness`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .harness import BatchedMLP, DistContext, Task, TrainConfig, evaluate, init_distributed, train

DESCRIPTION = "chemical-process surrogates with mass balances (CSTR, plant, distillation)"

__all__ = ["DESCRIPTION", "ChemicalData", "ChemicalTask", "add_arguments", "load_config", "load_dataset",
           "reproduce", "run", "summarize"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
OURS = ("ours", "ours-L1", "ours-NLL", "ours-sg", "ours-NLL-sg")
#: ours variants whose log-variance head sees stop-gradient features (it cannot shape the shared hidden layers)
STOP_GRADIENT = ("ours-sg", "ours-NLL-sg")


# ----------------------------------------------------------------------------------------------------------
# configuration and data
# ----------------------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """The study's settings (``configs/chemical.json`` shipped with the package, or ``path``)."""
    if path is None:
        text = resources.files("hardeq.experiments").joinpath("configs/chemical.json").read_text()
    else:
        text = Path(path).read_text()
    return json.loads(text)


@dataclass
class ChemicalData:
    r"""One data set, MaxAbs-scaled, with the balances in scaled units :math:`B_s y_s = b - A_s x_s`.

    Attributes:
        name: ``"cstr"``, ``"plant"`` or ``"distillation"``.
        x, y: scaled inputs ``(N, n_x)`` and outputs ``(N, n)``, float64, file order.
        B, A, b: scaled constraint ``B_s = B diag(s_y)`` ``(a, n)``, ``A_s = A diag(s_x)`` ``(a, n_x)``, ``b``.
        scale_x, scale_y: the MaxAbs scales (max |column| over the whole file).
        columns: header names.
        splits: ``{"train": slice, "val": slice, "test": slice}`` (file order).
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    B: np.ndarray
    A: np.ndarray
    b: np.ndarray
    scale_x: np.ndarray
    scale_y: np.ndarray
    columns: list[str]
    splits: dict[str, slice]

    def residual(self) -> np.ndarray:
        r""":math:`B_s y_s + A_s x_s - b` of the data, ``(N, a)`` (round-off: the balances hold exactly)."""
        return self.y @ self.B.T + self.x @ self.A.T - self.b

    def tensors(self, split: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        sl = self.splits[split]
        return {"x": torch.as_tensor(self.x[sl], dtype=dtype, device=device),
                "y": torch.as_tensor(self.y[sl], dtype=dtype, device=device)}


def load_dataset(name: str, config: Mapping[str, Any] | None = None) -> ChemicalData:
    """Load, scale and split data set ``name`` as the reference code does (see the module docstring)."""
    config = config or load_config()
    if name not in config["datasets"]:
        raise ValueError(f"unknown data set {name!r}; available: {sorted(config['datasets'])}.")
    spec = config["datasets"][name]
    res = resources.files("hardeq").joinpath("data/chemical_process").joinpath(spec["file"])
    with res.open("r") as fh:
        header = fh.readline().strip().split(",")
        raw = np.loadtxt(fh, delimiter=",", dtype=np.float64)
    nx = int(spec["num_inputs"])
    scale = np.abs(raw).max(axis=0)  # sklearn's MaxAbsScaler fitted on the whole file
    scale[scale == 0] = 1.0
    scaled = raw / scale
    B = np.asarray(spec["B"], dtype=np.float64) * scale[nx:]
    A = np.asarray(spec["A"], dtype=np.float64) * scale[:nx]
    b = np.asarray(spec["b"], dtype=np.float64)
    N = raw.shape[0]
    f_train, f_val, f_test = config["split"]
    n_val, n_test = int(f_val * N), int(f_test * N)  # as the reference: train gets the remainder
    n_train = N - n_val - n_test
    splits = {"train": slice(0, n_train), "val": slice(n_train, n_train + n_val),
              "test": slice(n_train + n_val, N)}
    return ChemicalData(name, scaled[:, :nx], scaled[:, nx:], B, A, b, scale[:nx], scale[nx:], header, splits)


# ----------------------------------------------------------------------------------------------------------
# the task: eight methods on one batched MLP
# ----------------------------------------------------------------------------------------------------------


class ChemicalTask(Task):
    r"""Losses and metrics of all methods on one batched MLP.

    Members are laid out method-major, ``S`` consecutive members (seeds) per method, in the order
    :attr:`layout` (the given methods with the ``ours*`` variants moved to the end, so that they form one
    block and share one :class:`~hardeq.ConstrainedNormal`: one factorisation per step, not one per variant).

    Args:
        data: the data set (its scaled constraint).
        methods: method names (see the module docstring).
        num_seeds: ``S`` members per method.
        pinn_weight: the reference's penalty weight ``w`` on the *mean* over constraint rows of the squared
            residual; :func:`hardeq.baselines.penalty_loss` sums over rows, so it gets ``w / a``.
        variance_floor: ``v_min`` added to the predicted variances of ``ours*``. The expected L2 and L1 losses
            are minimised by zero variance, so their log-variances drift down without bound (to -50 after 175
            epochs on distillation); the conditional mean only depends on variance *ratios*, but ratios of
            1e13 break float32 (NaN in the backward pass of the folded-normal mean, a singular
            :math:`B\Sigma B^\top`). A floor of 1e-8 (std 1e-4 in scaled units, 1% of the typical error)
            bounds the ratios; it is practically inactive for the NLL variants, whose variances settle.
        ecnn_dependent: the dependent outputs of ECNN (the reference's: the first ``a``).
        fused_baselines: apply the baselines (NN, PINN, KKT-hPINN, ECNN, CL, CL-coord) through their exact
            linear maps ``pred = out P + k Q``, read once off the library layers in float64, as one batched
            matmul for all baseline members (several times cheaper per step than one layer call per method;
            the tests check it equals calling the layers). ``False`` calls the layers.
    """

    def __init__(self, data: ChemicalData, methods: Sequence[str], num_seeds: int, *, pinn_weight: float,
                 ecnn_dependent: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu",
                 variance_floor: float = 0.0, fused_baselines: bool = True) -> None:
        unknown = [m for m in methods if m not in METHOD_NAMES]
        if unknown or not methods:
            raise ValueError(f"unknown methods {unknown or methods}; available: {list(METHOD_NAMES)}.")
        if len(set(methods)) != len(methods):
            raise ValueError(f"methods must not repeat, got {list(methods)}.")
        self.layout = [m for m in methods if m not in OURS] + [m for m in methods if m in OURS]
        self.S = S = int(num_seeds)
        self.slices = {m: slice(i * S, (i + 1) * S) for i, m in enumerate(self.layout)}
        n_plain = sum(m not in OURS for m in self.layout)
        self.ours = [m for m in self.layout if m in OURS]
        self.ours_block = slice(n_plain * S, len(self.layout) * S)
        self.B = torch.as_tensor(data.B, dtype=dtype, device=device)  # (a, n)
        self.A = torch.as_tensor(data.A, dtype=dtype, device=device)  # (a, n_x)
        self.b = torch.as_tensor(data.b, dtype=dtype, device=device)  # (a,)
        a, n = self.B.shape
        self.n, self.a = n, a
        self.pinn_weight = float(pinn_weight) / a
        self.variance_floor = float(variance_floor)
        # CL: variables ranked by their largest |coefficient| in B (ascending): each balance is solved for a
        # variable with a large coefficient. The default (coordinate) order is the extra method "CL-coord".
        self.cl_order = [int(i) for i in np.argsort(np.abs(data.B).max(0), kind="stable")]
        self.ecnn_dependent = [int(i) for i in ecnn_dependent]
        self.layers = self._make_layers(self.B)
        self.widths = {m: (n - a if m == "ECNN" else 2 * n if m in OURS else n) for m in self.layout}
        self.out_sizes = [self.widths[m] for m in self.layout for _ in range(S)]
        #: (M, max width): the log-variance outputs of the stop-gradient variants (for ``BatchedMLP``)
        self.detach_outputs = torch.zeros(self.num_members, max(self.out_sizes), dtype=torch.bool)
        for m in STOP_GRADIENT:
            if m in self.slices:
                self.detach_outputs[self.slices[m], n: 2 * n] = True
        self.plain = [m for m in self.layout if m not in OURS]
        self.fused_baselines = bool(fused_baselines)
        if self.plain and self.fused_baselines:
            # every baseline is a fixed linear map of (network output, k): read its matrices off the library
            # layer (float64, evaluated on basis vectors) and apply all baseline members in one batched matmul
            layers64 = self._make_layers(self.B.to(torch.float64))
            w = max(self.widths[m] for m in self.plain)
            P = torch.zeros(len(self.plain) * S, w, n, dtype=torch.float64)
            Q = torch.zeros(len(self.plain) * S, a, n, dtype=torch.float64)
            for i, m in enumerate(self.plain):
                Pm, Qm = _linear_map(lambda y, k, _m=m: self._apply_layer(_m, y, k, layers64), self.widths[m], a)
                P[i * S: (i + 1) * S, : self.widths[m]] = Pm
                Q[i * S: (i + 1) * S] = Qm
            self.P = P.to(dtype=dtype, device=device)  # (M_plain, w, n)
            self.Q = Q.to(dtype=dtype, device=device)  # (M_plain, a, n)
            self.plain_width = w

    def _make_layers(self, B: Tensor) -> dict[str, Any]:
        """The library's baseline layers for constraint matrix ``B`` (in ``B``'s dtype)."""
        from hardeq.baselines import ConstraintLayer, EqualityCompletion, KKTProjection

        return {"KKT-hPINN": KKTProjection(B), "CL": ConstraintLayer(B, order=self.cl_order),
                "CL-coord": ConstraintLayer(B), "ECNN": EqualityCompletion(B, dependent=self.ecnn_dependent)}

    def _apply_layer(self, method: str, out: Tensor, k: Tensor, layers: dict[str, Any]) -> Tensor:
        """The library layer of ``method`` applied to raw outputs ``out`` ``(..., width)`` and ``k``."""
        if method in ("NN", "PINN"):
            return out
        k = k.expand(out.shape[:-1] + (self.a,))
        if method == "ECNN":
            return layers["ECNN"].complete(out, k)
        return layers[method](out, k)

    @property
    def num_members(self) -> int:
        return len(self.layout) * self.S

    def member_seeds(self, seeds: Sequence[int]) -> list[int]:
        return [int(s) for _ in self.layout for s in seeds]

    def constraint_value(self, x: Tensor) -> Tensor:
        """Per-sample right-hand side ``k = b - A x``, ``(..., a)``."""
        return self.b - x @ self.A.T

    def distribution(self, out: Tensor, k: Tensor):
        r"""``ConstrainedNormal`` given ``B y = k`` with mean ``out[..., :n]`` and variance
        :math:`e^{\text{out}[..., n:2n]} + v_{\min}` (the floor :attr:`variance_floor`, see the class docstring)."""
        from hardeq import ConstrainedNormal, LinearConstraint

        n = self.n
        loc, log_var = out[..., :n], out[..., n: 2 * n]
        scale = torch.sqrt(torch.exp(log_var) + self.variance_floor)
        return ConstrainedNormal(loc, scale, constraint=LinearConstraint(self.B, k, validate_args=False),
                                 validate_args=False)

    @staticmethod
    def _rows(t: Tensor, sl: slice) -> Tensor:
        """Members ``sl`` of a per-member tensor ``(M, b, ...)``; a shared ``(N, ...)`` tensor passes through."""
        return t[sl] if t.dim() == 3 else t

    def _predictions(self, output: Tensor, batch: Mapping[str, Tensor]):
        """Predictions ``(M, b, n)`` in layout order, the ``ours*`` block's distribution (or None) and ``k``."""
        k = self.constraint_value(batch["x"])
        preds, dist = [], None
        if self.plain and self.fused_baselines:
            blk = slice(0, self.ours_block.start)
            preds.append(torch.baddbmm(torch.matmul(self._rows(k, blk), self.Q), output[blk, :, : self.plain_width],
                                       self.P))
        elif self.plain:
            for m in self.plain:
                sl = self.slices[m]
                preds.append(self._apply_layer(m, output[sl, :, : self.widths[m]], self._rows(k, sl), self.layers))
        if self.ours:
            blk = self.ours_block
            dist = self.distribution(output[blk, :, : 2 * self.n], self._rows(k, blk))
            preds.append(dist.mean)
        return torch.cat(preds, 0), dist, k

    def loss(self, output: Tensor, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        from hardeq import LinearConstraint
        from hardeq.baselines import penalty_loss

        y = batch["y"]
        pred, dist, k = self._predictions(output, batch)
        sq = (pred - y).square().mean(-1)  # (M, b): squared error of every member's prediction
        losses = [sq[: self.ours_block.start]]
        if "PINN" in self.slices:
            sl = self.slices["PINN"]
            c = LinearConstraint(self.B, k[sl], validate_args=False)
            losses[0] = torch.cat([sq[: sl.start], sq[sl] + penalty_loss(pred[sl], c, weight=self.pinn_weight,
                                                                          reduction="none"),
                                   sq[sl.stop: self.ours_block.start]])
        if self.ours:
            y_o = y[self.ours_block]
            for m in self.ours:
                rel = slice(self.slices[m].start - self.ours_block.start, self.slices[m].stop - self.ours_block.start)
                if m in ("ours", "ours-sg"):
                    losses.append(dist.expected_l2(y_o)[rel].mean(-1))
                elif m == "ours-L1":
                    losses.append(dist.expected_l1(y_o)[rel].mean(-1))
                else:  # ours-NLL(-sg): per output coordinate, like the MSE
                    losses.append(-dist.log_prob(y_o)[rel] / self.n)
        return torch.cat(losses, 0), {"mse": sq.detach()}

    def metrics(self, output: Tensor, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        pred, _, k = self._predictions(output, batch)
        mse = (pred - batch["y"]).square().mean((-2, -1))
        violation = (pred @ self.B.T - k).abs().mean((-2, -1))
        log_var = output.new_full((self.num_members,), math.nan)
        if self.ours:
            log_var[self.ours_block] = output[self.ours_block, :, self.n: 2 * self.n].mean((-2, -1))
        return {"mse": mse, "violation": violation, "log_var": log_var}


def _linear_map(fn: Callable[[Tensor, Tensor], Tensor], width: int, a: int) -> tuple[Tensor, Tensor]:
    r"""Matrices ``P`` ``(width, n)`` and ``Q`` ``(a, n)`` of a map linear in ``(y, k)``: ``fn(y, k) = y P + k Q``.

    Read off by evaluating ``fn`` on basis vectors (float64); raises ``ValueError`` if ``fn`` is not linear
    (a non-zero constant term, or a mismatch on a random probe).
    """
    with torch.no_grad():
        eye_y = torch.eye(width, dtype=torch.float64)
        eye_k = torch.eye(a, dtype=torch.float64)
        zero = fn(torch.zeros(1, width, dtype=torch.float64), torch.zeros(1, a, dtype=torch.float64))
        P = fn(eye_y, torch.zeros(width, a, dtype=torch.float64))
        Q = fn(torch.zeros(a, width, dtype=torch.float64), eye_k)
        gen = torch.Generator().manual_seed(0)
        y = torch.randn(4, width, generator=gen, dtype=torch.float64)
        k = torch.randn(4, a, generator=gen, dtype=torch.float64)
        scale = 1 + P.abs().sum() + Q.abs().sum()
        if zero.abs().max() > 1e-12 * scale or (fn(y, k) - (y @ P + k @ Q)).abs().max() > 1e-10 * scale:
            raise ValueError("the layer is not linear in (y, k); cannot fuse it")
    return P, Q


#: every method the task knows (the config lists the ones a run trains)
METHOD_NAMES = ("NN", "PINN", "KKT-hPINN", "ECNN", "CL", "CL-coord", *OURS)


# ----------------------------------------------------------------------------------------------------------
# running the study
# ----------------------------------------------------------------------------------------------------------


def _summary(values: Tensor) -> tuple[float, float]:
    v = values.to(torch.float64)
    return float(v.mean()), float(v.std(unbiased=True)) if v.numel() > 1 else 0.0


def _paper(config: Mapping[str, Any], dataset: str, method: str) -> tuple[float | None, float | None]:
    p = config["paper"]
    if method not in p["methods"] or dataset not in p:
        return None, None
    mean, std = p[dataset][p["methods"].index(method)]
    return mean * p["unit"], std * p["unit"]


def run_dataset(
    name: str,
    config: Mapping[str, Any],
    seeds: Sequence[int],
    *,
    epochs: int,
    methods: Sequence[str] | None = None,
    dtype: str | None = None,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[str, int, dict], None] | None = None,
    ctx: DistContext | None = None,
    position: int = 0,
    part: str = "",
) -> dict[str, Any]:
    """Train every method (x every seed, as one batched model) on data set ``name`` and evaluate it.

    ``part`` names a subset of the methods trained separately (checkpoint ``chemical-NAME-PART.pt``).
    Returns ``{"records", "curves", "per_seed", "seconds", "cpu_seconds"}`` (see :func:`run`).
    """
    ctx = ctx or DistContext()
    methods = list(methods or config["methods"])
    torch_dtype = _DTYPES[dtype or config["dtype"]]
    seeds = [int(s) for s in seeds]
    S = len(seeds)
    t0, c0 = time.perf_counter(), time.process_time()
    train_cfg = TrainConfig(epochs=int(epochs), batch_size=int(config["train"]["batch_size"]),
                            lr=float(config["train"]["lr"]), select_metric=config["train"]["select_metric"],
                            checkpoint_every=int(config["train"]["checkpoint_every"]))
    data = load_dataset(name, config)
    task = ChemicalTask(data, methods, S, pinn_weight=config["pinn_weight"],
                        variance_floor=config["ours"]["variance_floor"],
                        ecnn_dependent=config["datasets"][name]["ecnn_dependent"], dtype=torch_dtype,
                        device=ctx.device)
    member_seeds = task.member_seeds(seeds)
    model = BatchedMLP(data.x.shape[1], config["model"]["hidden"], task.out_sizes, member_seeds,
                       detach_outputs=task.detach_outputs,
                       activation=config["model"]["activation"], dtype=torch_dtype, device=ctx.device)
    splits = {s: data.tensors(s, torch_dtype, ctx.device) for s in ("train", "val", "test")}
    label = f"{name}-{part}" if part else name
    ckpt = None if checkpoint_dir is None else Path(checkpoint_dir) / f"chemical-{label}.pt"
    cb = None if callback is None else (lambda epoch, info: callback(name, epoch, info))
    result = train(model, task, splits["train"], splits["val"], train_cfg, member_seeds,
                   checkpoint_path=ckpt, resume=resume, progress=progress, desc=label, callback=cb, ctx=ctx,
                   position=position, log_every=int(config["train"].get("log_every", 0)),
                   run_id={"study": "chemical", "dataset": name, "layout": task.layout, "seeds": seeds,
                           "dtype": str(torch_dtype), "model": config["model"],
                           "pinn_weight": config["pinn_weight"], "ours": config["ours"],
                           "data": config["datasets"][name]})
    test_best = evaluate(model, task, splits["test"], result.best_state)
    test_last = evaluate(model, task, splits["test"], result.final_state)
    val_best = evaluate(model, task, splits["val"], result.best_state)
    records: list[dict[str, Any]] = []
    per_seed: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    for m in methods:
        sl = task.slices[m]
        metrics = {
            "test_mse": test_best["mse"][sl],
            "violation": test_best["violation"][sl],
            "val_mse": val_best["mse"][sl],
            "test_mse_last_epoch": test_last["mse"][sl],
            "violation_last_epoch": test_last["violation"][sl],
            "best_epoch": result.best_epoch[sl].to(torch.float64),
        }
        if m in OURS:
            metrics["mean_log_variance"] = test_best["log_var"][sl]
        per_seed[m] = {k: [float(v) for v in t.cpu()] for k, t in metrics.items()}
        for metric, values in metrics.items():
            mean, std = _summary(values.cpu())
            rec: dict[str, Any] = {"dataset": name, "method": m, "metric": metric, "mean": mean, "std": std,
                                   "n_seeds": S}
            if metric == "test_mse":
                rec["paper"], rec["paper_std"] = _paper(config, name, m)
            records.append(rec)
        curves[m] = {k.removesuffix("_mse"): [float(v) for v in result.history[k][:, sl].mean(1)]
                     for k in ("train_mse", "val_mse") if k in result.history}
        if m in OURS and "val_log_var" in result.history:
            curves[m]["val_log_var"] = [float(v) for v in result.history["val_log_var"][:, sl].mean(1)]
    return {"records": records, "curves": curves, "per_seed": per_seed, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0}


def _worker(name: str, kwargs: dict[str, Any], threads: int) -> dict[str, Any]:
    """Process-pool entry point: one data set in a fresh process with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    return run_dataset(name, **kwargs)


def run(
    config: Mapping[str, Any],
    seeds: Sequence[int],
    *,
    epochs: int,
    datasets: Sequence[str] | None = None,
    methods: Sequence[str] | None = None,
    dtype: str | None = None,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[str, int, dict], None] | None = None,
    ctx: DistContext | None = None,
    jobs: int = 1,
    threads: int = 1,
) -> dict[str, Any]:
    """Train and evaluate every method on every data set; prints nothing.

    Args:
        jobs: data sets trained in parallel processes (``spawn``; largest data set first). Each data set is
            trained by exactly the same code either way, so results do not depend on ``jobs``. Ignored
            (1) under ``torchrun`` and when a ``callback`` is given.
        threads: intra-op threads of each worker (the per-step tensors are tiny: 1 is fastest).

    Returns:
        ``{"records": [...], "curves": {dataset: {method: {"train": [...], "val": [...]}}},
        "per_seed": {dataset: {method: {metric: [...]}}}, "timing": {dataset: seconds}}``; records follow
        DESIGN.md section 5 (``dataset``, ``method``, ``metric``, ``mean``, ``std``, ``n_seeds``, ``paper``).
    """
    ctx = ctx or DistContext()
    datasets = list(datasets or config["datasets"])
    methods = list(methods or config["methods"])
    kwargs = dict(config=config, seeds=list(seeds), epochs=epochs, dtype=dtype, checkpoint_dir=checkpoint_dir,
                  resume=resume, progress=progress)
    units = _units(config, datasets, methods, split=jobs > 1 and not ctx.enabled and callback is None)
    jobs = max(1, min(int(jobs), len(units)))
    results: dict[str, dict[str, Any]] = {}
    if jobs == 1 or ctx.enabled or callback is not None:
        for label, (name, part, ms) in units.items():
            results[label] = run_dataset(name, **kwargs, methods=ms, part=part, callback=callback, ctx=ctx)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {label: pool.submit(_worker, name, {**kwargs, "methods": ms, "part": part, "position": i},
                                          threads)
                       for i, (label, (name, part, ms)) in enumerate(units.items())}
            results = {label: f.result() for label, f in futures.items()}
    out: dict[str, Any] = {"records": [], "curves": {}, "per_seed": {}, "timing": {}, "cpu_timing": {}}
    for name in datasets:
        labels = [label for label, u in units.items() if u[0] == name]
        recs = [r for label in labels for r in results[label]["records"]]
        out["records"] += sorted(recs, key=lambda r: methods.index(r["method"]))  # stable: metric order kept
        for key in ("curves", "per_seed"):
            merged = {m: v for label in labels for m, v in results[label][key].items()}
            out[key][name] = {m: merged[m] for m in methods}
    for label in units:
        out["timing"][label] = results[label]["seconds"]
        out["cpu_timing"][label] = results[label]["cpu_seconds"]
    return out


def _units(config: Mapping[str, Any], datasets: Sequence[str], methods: Sequence[str], split: bool
           ) -> dict[str, tuple[str, str, list[str]]]:
    """Training units ``label -> (data set, part, methods)``, costliest first.

    Without ``split`` one unit per data set. With it (parallel jobs), the data set with the most training
    steps is split into its baseline block and its ``ours*`` block: members are independent, so this only
    changes which process trains them, and balances two workers (distillation alone has 65% of all steps).
    """
    steps = {name: load_dataset(name, config).splits["train"].stop for name in datasets}
    units = {name: (name, "", list(methods)) for name in datasets}
    plain = [m for m in methods if m not in OURS]
    ours = [m for m in methods if m in OURS]
    if split and plain and ours and datasets:
        big = max(datasets, key=steps.__getitem__)
        del units[big]
        units[f"{big}-baselines"] = (big, "baselines", plain)
        units[f"{big}-ours"] = (big, "ours", ours)

    def cost(u: tuple[str, str, list[str]]) -> float:  # measured CPU ms per step, roughly
        has_plain = any(m not in OURS for m in u[2])
        num_ours = sum(m in OURS for m in u[2])
        return steps[u[0]] * (0.5 + 1.2 * has_plain + 0.6 * num_ours)

    return dict(sorted(units.items(), key=lambda kv: -cost(kv[1])))


# ----------------------------------------------------------------------------------------------------------
# rendering
# ----------------------------------------------------------------------------------------------------------


def _fmt(mean: float | None, std: float | None, unit: float = 1e-4) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    return f"{mean / unit:.3g} ± {std / unit:.2g}"


def summarize(records: Sequence[Mapping[str, Any]], methods: Sequence[str], datasets: Sequence[str]) -> str:
    """Markdown tables: test MSE (x 1e-4) next to the paper's, and mean absolute constraint violation."""
    from .results import markdown_table

    idx = {(r["dataset"], r["method"], r["metric"]): r for r in records}
    lines = ["### Test MSE (scaled outputs, x 1e-4; mean ± std over seeds) — ours vs paper", ""]
    header = ["method"] + [f"{d} (here)" for d in datasets] + [f"{d} (paper)" for d in datasets]
    rows = []
    for m in methods:
        here = [_fmt(idx[(d, m, "test_mse")]["mean"], idx[(d, m, "test_mse")]["std"])
                if (d, m, "test_mse") in idx else "–" for d in datasets]
        paper = [_fmt(idx[(d, m, "test_mse")].get("paper"), idx[(d, m, "test_mse")].get("paper_std"))
                 if (d, m, "test_mse") in idx else "–" for d in datasets]
        rows.append([m] + here + paper)
    lines.append(markdown_table(header, rows))
    extra = [("violation", "Mean absolute constraint violation on the test set (scaled units)", 1.0, ".2e"),
             ("test_mse_last_epoch", "Test MSE after the last epoch (x 1e-4; the reference code's effective "
              "choice)", 1e-4, ".3g"),
             ("val_mse", "Validation MSE at the selected epoch (x 1e-4)", 1e-4, ".3g"),
             ("best_epoch", "Selected (best-validation) epoch", 1.0, ".0f"),
             ("mean_log_variance", "Mean predicted log-variance (ours; scaled units)", 1.0, ".2f")]
    for metric, title, unit, spec in extra:
        if not any(k[2] == metric for k in idx):
            continue
        rows = []
        for m in methods:
            row = [m]
            for d in datasets:
                r = idx.get((d, m, metric))
                row.append("–" if r is None else f"{r['mean'] / unit:{spec}} ± {r['std'] / unit:{spec}}")
            rows.append(row)
        lines += ["", f"### {title}", "", markdown_table(["method"] + list(datasets), rows)]
    return "\n".join(lines)


def plot_curves(curves: Mapping[str, Any], out: Path, prefix: str = "chemical") -> list[Path]:
    """One PNG per data set: training and validation MSE per epoch (mean over seeds), one line per method,
    and the mean predicted log-variance of the ``ours*`` variants.

    Methods whose final MSE is more than 100 times the median method's are drawn but left off the y-range
    (marked "off scale" in the legend), so that one diverging method does not flatten the others.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, per_method in curves.items():
        has_lv = any("val_log_var" in c for c in per_method.values())
        fig, axes = plt.subplots(1, 3 if has_lv else 2, figsize=(16 if has_lv else 11, 4.2))
        for ax, split in zip(axes, ("train", "val")):
            finals = {m: c[split][-1] for m, c in per_method.items() if split in c and c[split]}
            ref = float(np.median(list(finals.values()))) if finals else 1.0
            shown = [m for m, v in finals.items() if np.isfinite(v) and v <= 100 * ref]
            for m, c in per_method.items():
                if split not in c:
                    continue
                off = m not in shown
                ax.plot(np.arange(1, len(c[split]) + 1), c[split], lw=1.2, ls="--" if m in OURS else "-",
                        label=f"{m} (off scale)" if off else m)
            values = np.concatenate([np.asarray(per_method[m][split][min(5, len(per_method[m][split]) - 1):])
                                     for m in shown]) if shown else np.array([1.0])
            values = values[np.isfinite(values) & (values > 0)]
            if values.size:
                ax.set_ylim(values.min() / 1.5, values.max() * 1.5)
            ax.set_yscale("log")
            ax.set_xlabel("epoch")
            ax.set_ylabel("MSE (scaled outputs)")
            ax.set_title(f"{name}: {'training' if split == 'train' else 'validation'} MSE (mean over seeds)")
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7, ncol=2)
        if has_lv:
            ax = axes[2]
            for m, c in per_method.items():
                if "val_log_var" in c:
                    ax.plot(np.arange(1, len(c["val_log_var"]) + 1), c["val_log_var"], lw=1.2, ls="--", label=m)
            ax.axhline(math.log(1e-8), color="gray", lw=0.8, ls=":", label="log 1e-8 (variance floor)")
            ax.set_xlabel("epoch")
            ax.set_ylabel("mean predicted log-variance")
            ax.set_title(f"{name}: ours* predicted log-variance (validation)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(out) / f"{prefix}.{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------------------
# CLI entry points
# ----------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--datasets", nargs="+", default=None, metavar="NAME",
                        help="subset of cstr, plant, distillation (default: all)")
    parser.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                        help="subset of the methods (default: all in the config)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the config's")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="default: OUT/checkpoints (removed after a completed run unless --keep-checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="epochs between checkpoints")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--config", type=Path, default=None, help="alternative config JSON")
    parser.add_argument("--jobs", type=int, default=None,
                        help="parallel worker processes; the units are the data sets, the largest split into its "
                             "baselines and its ours* variants (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or table")


def reproduce(args: argparse.Namespace) -> dict[str, Any]:
    """``hardeq reproduce chemical``: run, print the table, write ``OUT/chemical.{json,md}`` and PNGs."""
    from .results import atomic_write_text, write_json

    config = load_config(getattr(args, "config", None))
    preset = config["presets"][args.preset]
    num_seeds = args.seeds if args.seeds is not None else preset["seeds"]
    epochs = args.epochs if args.epochs is not None else preset["epochs"]
    if getattr(args, "checkpoint_every", None):
        config["train"]["checkpoint_every"] = int(args.checkpoint_every)
    out = Path(args.out)
    ckpt_dir = getattr(args, "checkpoint_dir", None) or out / "checkpoints"
    quiet = bool(getattr(args, "quiet", False))
    ctx = init_distributed()
    threads = int(getattr(args, "threads", 1) or 1)
    jobs = getattr(args, "jobs", None) or preset.get("jobs", 1)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    result = run(config, list(range(num_seeds)), epochs=epochs, datasets=getattr(args, "datasets", None),
                 methods=getattr(args, "methods", None), dtype=getattr(args, "dtype", None),
                 checkpoint_dir=ckpt_dir, resume=bool(args.resume), progress=not quiet, ctx=ctx, jobs=jobs,
                 threads=threads)
    wall = time.perf_counter() - t0
    datasets = list(result["curves"])
    methods = list(next(iter(result["curves"].values())))
    used = {**config, "preset": args.preset, "seeds": list(range(num_seeds)), "epochs": epochs,
            "datasets_run": datasets, "methods_run": methods, "dtype_run": getattr(args, "dtype", None)
            or config["dtype"], "world_size": ctx.world_size, "jobs": jobs, "threads": threads}
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        doc = write_json(out / "chemical.json", "chemical", args.preset, used, result["records"],
                         per_seed=result["per_seed"], timing={"total_s": wall, **result["timing"]},
                         cpu_timing=result["cpu_timing"])
        atomic_write_text(out / "chemical.curves.json", json.dumps(result["curves"]) + "\n")
        table = summarize(result["records"], methods, datasets)
        md = (f"# chemical — mass-balance surrogates ({args.preset} preset)\n\n"
              f"{len(range(num_seeds))} seeds x {epochs} epochs, dtype {used['dtype_run']}, "
              f"world size {ctx.world_size}; wall time {wall:.0f} s "
              f"({', '.join(f'{k} {v:.0f} s' for k, v in result['timing'].items())}; CPU time "
              f"{', '.join(f'{k} {v:.0f} s' for k, v in result['cpu_timing'].items())}). "
              f"Environment: torch {doc['environment']['torch']}, {doc['environment']['device']}, "
              f"{doc['environment']['threads']} threads, git {doc['environment']['git']}.\n\n"
              f"{table}\n\nLearning curves: "
              + ", ".join(f"`chemical.{d}.png`" for d in datasets) + ". Protocol and discussion: docs/chemical.md.\n")
        atomic_write_text(out / "chemical.md", md)
        plot_curves(result["curves"], out)
        if not quiet:
            print(table)
            print(f"\nwrote {out / 'chemical.json'}, {out / 'chemical.md'} and plots in {wall:.1f} s")
        if not getattr(args, "keep_checkpoints", False):
            for p in Path(ckpt_dir).glob("chemical-*.pt"):
                p.unlink()
            try:
                Path(ckpt_dir).rmdir()
            except OSError:
                pass
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return result
