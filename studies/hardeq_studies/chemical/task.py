r"""The ``chemical`` task: losses and metrics of every method, on one batched model.

============  ==========================================================================================
NN            unconstrained MLP, MSE loss
PINN          MSE + soft penalty :math:`w \cdot \mathrm{mean}_j (B\hat y - k)_j^2` (``penalty_loss``, w = 1)
KKT-hPINN     orthogonal projection of the MLP output onto :math:`\{By = k\}` (``KKTProjection``), MSE
ECNN          MLP predicts the ``n - a`` independent outputs, the dependent ones are solved
              (``EqualityCompletion.complete``), MSE
CL            constraint layer (``ConstraintLayer``): each balance solved for its variable with the largest
              scaled coefficient, MSE
CL-coord      the same layer with its default (coordinate) variable order
ours          MLP outputs a mean and a log-variance per output; ``ConstrainedNormal`` conditioned on
              ``LinearConstraint(B, b - A x)``; closed-form expected L2 loss; prediction = conditional mean
ours-L1       the same with the closed-form expected L1 loss
ours-NLL      the same trained by the negative log-density of the target on the constraint plane
ours-sg       ours with the log-variance head on stop-gradient features
ours-NLL-sg   ours-NLL with the log-variance head on stop-gradient features
ours-NLL-sepnet   ours-NLL with the log-variances from a *separate* network (same architecture, own
              parameters; it starts as a copy of the mean network's hidden layers and log-variance head)
ours-bNLL     beta-NLL (Seitzer et al., ICLR 2022) on the constraint plane: the NLL of each sample weighted by
              ``stopgrad(v)^beta``, ``v`` the geometric mean of the conditional variances on the plane
              (:math:`\det(\Sigma_{\text{plane}})^{1/(n-a)}`), beta from the config (0.5)
ours-NLL-homvar   ours-NLL with one learned log-variance per output (the last layer's bias; the same for
              every input), so the variance cannot shape the features
ours-tNLL     trained through the bounds: the negative log-density of the target under the law truncated to
              the data set's non-negative flows (``truncate(lower, training=chains)``; the gradient of
              :math:`\log Z` from persistent Gibbs chains, ``tnll_chains`` x ``tnll_sweeps`` per step; the loss
              value is the *unnormalised* NLL, docs/bounds.md); prediction = conditional mean, and with the
              bounds the rules of chemical/bounds.py
============  ==========================================================================================

``ours*`` members form one block that shares one :class:`~hardeq.ConstrainedNormal` (one factorisation per
step for all variants); the separate variance networks of ``ours-NLL-sepnet`` are extra members after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..harness import Task
from .data import ChemicalData

__all__ = ["BASELINES", "OURS", "METHOD_NAMES", "STOP_GRADIENT", "ChemicalTask", "linear_map"]

BASELINES = ("NN", "PINN", "KKT-hPINN", "ECNN", "CL", "CL-coord")
OURS = ("ours", "ours-L1", "ours-NLL", "ours-sg", "ours-NLL-sg", "ours-NLL-sepnet", "ours-bNLL", "ours-NLL-homvar",
        "ours-tNLL")
#: every method the task knows (the config lists the ones a run trains)
METHOD_NAMES = BASELINES + OURS
#: ours variants whose log-variance head sees stop-gradient features
STOP_GRADIENT = ("ours-sg", "ours-NLL-sg")
#: ours variants whose log-variance is a learned constant per output
BIAS_ONLY = ("ours-NLL-homvar",)
#: ours variants whose log-variance comes from a separate network (extra members "<method>/var")
SEPARATE = ("ours-NLL-sepnet",)
_NLL = ("ours-NLL", "ours-NLL-sg", "ours-NLL-sepnet", "ours-NLL-homvar")
#: the ours variant trained through the truncated likelihood (needs the task's ``lower`` bounds)
TRUNCATED = "ours-tNLL"


class ChemicalTask(Task):
    r"""Losses and metrics of all methods on one batched MLP.

    Members are laid out method-major, ``S`` consecutive members (seeds) per method, in the order
    :attr:`layout`: the baselines, then the ``ours*`` block, then the variance networks of :data:`SEPARATE`.

    Args:
        data: the data set (its scaled constraint).
        methods: method names (:data:`METHOD_NAMES`).
        num_seeds: ``S`` members per method.
        pinn_weight: the reference's penalty weight ``w`` on the *mean* over constraint rows of the squared
            residual; :func:`hardeq.baselines.penalty_loss` sums over rows, so it gets ``w / a``.
        ecnn_dependent: the dependent outputs of ECNN (the reference's: the first ``a``).
        variance_floor: ``v_min`` added to the predicted variances of ``ours*``: the expected L2 and L1 losses
            are minimised by zero variance, so their log-variances drift down without bound; a floor of 1e-8
            bounds the variance ratios that float32 must handle.
        beta: the exponent of ``ours-bNLL``.
        same_init: every method of one seed starts from the same network: the ``ours*`` mean head equals the
            baselines' output layer (``False``: the ``ours*`` output layer is the one ``nn.Linear(h, 2n)``
            draws, whose mean-head biases differ -- the initialisation before this was fixed).
        fused_baselines: apply the baselines through their exact linear maps ``pred = out P + k Q`` (read once
            off the library layers in float64) as one batched matmul; ``False`` calls the layers.
        lower: ``(n,)`` lower bounds of :data:`TRUNCATED`'s truncation (``-inf``: a signed output); required when
            it is among ``methods``.
        chains, sweeps: its persistent chains per sample and sweeps per step (the
            :class:`hardeq.bounds.PersistentChains` of its first truncation, kept in :attr:`chains` across steps).
    """

    def __init__(self, data: ChemicalData, methods: Sequence[str], num_seeds: int, *, pinn_weight: float,
                 ecnn_dependent: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu",
                 variance_floor: float = 0.0, beta: float = 0.5, same_init: bool = True,
                 fused_baselines: bool = True, lower: Tensor | None = None, chains: int = 4, sweeps: int = 4) -> None:
        unknown = [m for m in methods if m not in METHOD_NAMES]
        if unknown or not methods:
            raise ValueError(f"unknown methods {unknown or list(methods)}; available: {list(METHOD_NAMES)}.")
        if len(set(methods)) != len(methods):
            raise ValueError(f"methods must not repeat, got {list(methods)}.")
        if TRUNCATED in methods and lower is None:
            raise ValueError(f"method {TRUNCATED!r} needs the lower bounds of its truncation (lower=, one per output).")
        self.lower = None if lower is None else torch.as_tensor(lower, dtype=dtype, device=device)
        self.chains: Any = None  # the PersistentChains of the first training-mode truncation, kept across steps
        self.num_chains, self.sweeps = int(chains), int(sweeps)
        self.S = S = int(num_seeds)
        self.plain = [m for m in methods if m not in OURS]
        self.ours = [m for m in methods if m in OURS]
        self.aux = [f"{m}/var" for m in self.ours if m in SEPARATE]
        self.layout = self.plain + self.ours + self.aux
        self.slices = {m: slice(i * S, (i + 1) * S) for i, m in enumerate(self.layout)}
        self.ours_block = slice(len(self.plain) * S, (len(self.plain) + len(self.ours)) * S)
        self.B = torch.as_tensor(data.B, dtype=dtype, device=device)  # (a, n)
        self.A = torch.as_tensor(data.A, dtype=dtype, device=device)  # (a, n_x)
        self.b = torch.as_tensor(data.b, dtype=dtype, device=device)  # (a,)
        a, n = self.B.shape
        self.n, self.a = n, a
        self.pinn_weight = float(pinn_weight) / a
        self.variance_floor = float(variance_floor)
        self.beta = float(beta)
        # CL: variables ranked by their largest |coefficient| in B (ascending), so each balance is solved for a
        # variable with a large coefficient; "CL-coord" keeps the default (coordinate) order.
        self.cl_order = [int(i) for i in np.argsort(np.abs(data.B).max(0), kind="stable")]
        self.ecnn_dependent = [int(i) for i in ecnn_dependent]
        self.layers = self._make_layers(self.B)
        self.widths = {m: (n - a if m == "ECNN" else n if m in self.plain else 2 * n) for m in self.layout}
        self.out_sizes = [self.widths[m] for m in self.layout for _ in range(S)]
        #: per member, the outputs initialised as the baselines' output layer (see ``same_init``)
        self.base_out_sizes = [n if (same_init and m in OURS) else self.widths[m]
                               for m in self.layout for _ in range(S)]
        self.detach_outputs = self._mask(STOP_GRADIENT)
        self.bias_only_outputs = self._mask(BIAS_ONLY)
        self.fused_baselines = bool(fused_baselines)
        if self.plain and self.fused_baselines:
            layers64 = self._make_layers(self.B.to(torch.float64))
            w = max(self.widths[m] for m in self.plain)
            P = torch.zeros(len(self.plain) * S, w, n, dtype=torch.float64)
            Q = torch.zeros(len(self.plain) * S, a, n, dtype=torch.float64)
            for i, m in enumerate(self.plain):
                Pm, Qm = linear_map(lambda y, k, _m=m: self._apply_layer(_m, y, k, layers64), self.widths[m], a)
                P[i * S: (i + 1) * S, : self.widths[m]] = Pm
                Q[i * S: (i + 1) * S] = Qm
            self.P = P.to(dtype=dtype, device=device)  # (M_plain, w, n)
            self.Q = Q.to(dtype=dtype, device=device)  # (M_plain, a, n)
            self.plain_width = w

    def _mask(self, methods: Sequence[str]) -> Tensor:
        """``(M, max width)``: the log-variance outputs of ``methods``."""
        mask = torch.zeros(self.num_members, max(self.out_sizes), dtype=torch.bool)
        for m in methods:
            if m in self.slices:
                mask[self.slices[m], self.n: 2 * self.n] = True
        return mask

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
        """Seed of every member (member ``j`` of every method gets ``seeds[j]``)."""
        return [int(s) for _ in self.layout for s in seeds]

    def constraint_value(self, x: Tensor) -> Tensor:
        """Per-sample right-hand side ``k = b - A x``, ``(..., a)``."""
        return self.b - x @ self.A.T

    def distribution(self, out: Tensor, k: Tensor):
        r"""``ConstrainedNormal`` given ``B y = k`` with mean ``out[..., :n]`` and variance
        :math:`e^{\text{out}[..., n:2n]} + v_{\min}`."""
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

    def _rel(self, m: str) -> slice:
        """Rows of method ``m`` within the ``ours*`` block."""
        s = self.slices[m]
        return slice(s.start - self.ours_block.start, s.stop - self.ours_block.start)

    def ours_outputs(self, output: Tensor) -> Tensor:
        """``(M_ours, b, 2n)``: means and log-variances of the ``ours*`` block, the log-variances of
        :data:`SEPARATE` methods taken from their variance networks."""
        out = output[self.ours_block, :, : 2 * self.n]
        if not self.aux:
            return out
        parts, start = [], 0
        for m in self.ours:
            if m in SEPARATE:
                r = self._rel(m)
                parts += [out[start: r.start], torch.cat([out[r, :, : self.n],
                                                          output[self.slices[f"{m}/var"], :, self.n: 2 * self.n]], -1)]
                start = r.stop
        return torch.cat(parts + [out[start:]], 0)

    def _predictions(self, output: Tensor, batch: Mapping[str, Tensor]):
        """Predictions ``(M_plain + M_ours, b, n)``, the ``ours*`` block's distribution (or None), ``k``."""
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
            dist = self.distribution(self.ours_outputs(output), self._rows(k, self.ours_block))
            preds.append(dist.mean)
        return torch.cat(preds, 0), dist, k

    def _with_aux(self, per_member: Tensor) -> Tensor:
        """Extend ``(M_plain + M_ours, ...)`` with the variance networks' rows (a copy of their partner's)."""
        if not self.aux:
            return per_member
        extra = [per_member[self.slices[m.removesuffix("/var")]] for m in self.aux]
        return torch.cat([per_member] + extra, 0)

    def loss(self, output: Tensor, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        from hardeq import LinearConstraint
        from hardeq.baselines import penalty_loss

        y = batch["y"]
        pred, dist, k = self._predictions(output, batch)
        sq = (pred - y[: pred.shape[0]] if y.dim() == 3 else pred - y).square().mean(-1)  # (M', b)
        losses = [sq[: self.ours_block.start]]
        if "PINN" in self.slices:
            sl = self.slices["PINN"]
            c = LinearConstraint(self.B, k[sl], validate_args=False)
            losses[0] = torch.cat([sq[: sl.start], sq[sl] + penalty_loss(pred[sl], c, weight=self.pinn_weight,
                                                                          reduction="none"),
                                   sq[sl.stop: self.ours_block.start]])
        if self.ours:
            y_o = y[self.ours_block]
            lp = -dist.log_prob(y_o) / self.n if any(m in _NLL or m == "ours-bNLL" for m in self.ours) else None
            for m in self.ours:
                rel = self._rel(m)
                if m in ("ours", "ours-sg"):
                    losses.append(dist.expected_l2(y_o)[rel].mean(-1))
                elif m == "ours-L1":
                    losses.append(dist.expected_l1(y_o)[rel].mean(-1))
                elif m == "ours-bNLL":
                    losses.append(self._beta_weight(dist)[rel] * lp[rel])
                elif m == TRUNCATED:
                    losses.append(self._truncated_nll(output, k, y_o[rel], rel))
                else:  # the NLL variants: per output coordinate, like the MSE
                    losses.append(lp[rel])
        if self.aux:
            losses.append(sq.new_zeros(len(self.aux) * self.S, sq.shape[1]))
        return torch.cat(losses, 0), {"mse": self._with_aux(sq.detach())}

    def _truncated_nll(self, output: Tensor, k: Tensor, y: Tensor, rel: slice) -> Tensor:
        """``(S, b)``: :data:`TRUNCATED`'s loss, the negative truncated log-density per output coordinate of ``y`` in
        training mode (the unnormalised value; the gradient of log Z from :attr:`chains`)."""
        assert self.lower is not None
        out = self.ours_outputs(output)[rel]
        k_o = self._rows(k, self.ours_block)
        dist = self.distribution(out, k_o[rel] if k_o.dim() == 3 else k_o)
        truncated = dist.truncate(self.lower.to(out.dtype), None, training=True if self.chains is None else self.chains)
        if self.chains is None:
            self.chains = truncated.training
            self.chains.chains, self.chains.sweeps = self.num_chains, self.sweeps
        return -truncated.log_prob(y) / self.n

    def _beta_weight(self, dist) -> Tensor:
        r"""``stopgrad(v)^beta`` per sample, ``v = det(Σ_plane)^{1/(n-a)}`` the geometric mean of the conditional
        variances on the plane, from the entropy :math:`H = \tfrac{n-a}{2}(1 + \log 2\pi) + \tfrac12\log\det
        \Sigma_{\text{plane}}`."""
        d = self.n - self.a
        log_v = 2.0 * dist.entropy().detach() / d - 1.0 - math.log(2 * math.pi)
        return torch.exp(self.beta * log_v)

    def metrics(self, output: Tensor, batch: Mapping[str, Tensor],
                generator: torch.Generator | None = None) -> dict[str, Tensor]:
        pred, _, k = self._predictions(output, batch)
        mse = (pred - batch["y"]).square().mean((-2, -1))
        violation = (pred @ self.B.T - k).abs().mean((-2, -1))
        log_var = output.new_full((pred.shape[0],), math.nan)
        if self.ours:
            log_var[self.ours_block] = self.ours_outputs(output)[:, :, self.n: 2 * self.n].mean((-2, -1))
        log_var = torch.cat([log_var, output.new_full((len(self.aux) * self.S,), math.nan)])
        return {"mse": self._with_aux(mse), "violation": self._with_aux(violation), "log_var": log_var}


def linear_map(fn: Callable[[Tensor, Tensor], Tensor], width: int, a: int) -> tuple[Tensor, Tensor]:
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
