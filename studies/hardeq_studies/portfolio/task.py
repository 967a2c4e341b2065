r"""The ``portfolio`` task: weight heads, the Sharpe objective, and the metrics of a weight vector.

=====================  =====================================================================================
StemGNN                ``w = softmax(o)`` over stocks (long-only), as in the reference
StemGNN-KKThPINN       ``y = (1 + o) / N`` projected orthogonally onto ``sum(w) = 1`` (``KKTProjection``)
StemGNN-CL             ``y = (1 + o) / N`` through the constraint layer (``ConstraintLayer``: the last stock's
                       weight is solved from the sum)
ours                   mean ``(1 + o) / N`` and standard deviation ``sqrt(exp(s) + floor) / N`` per stock;
                       ``ConstrainedNormal`` given ``SumConstraint`` total 1; trained through the expected
                       objective with ``rsample(estimator="marginal_expectation")``; evaluated at its
                       conditional mean
ours-pathwise          the same trained with ``estimator="pathwise"``
=====================  =====================================================================================

``o`` (and ``s``) are the weight head's outputs per stock; the offset ``1`` and the scale ``1 / N`` make a zero
output the equal-weight portfolio for every head, as ``softmax(0)`` is.

Sharpe ratio of weights ``w`` on one window with daily returns ``r`` ``(H, N)``: the portfolio's daily returns
``p = r w`` (held at constant weights), :math:`S = (252\,\bar p - r_f) / (\sqrt{252}\,\mathrm{sd}(p))` with
``r_f = 0.03`` and the unbiased standard deviation; this equals :math:`(w^\top\mu - r_f)/\sqrt{w^\top\Sigma w}`
with the annualised mean and covariance of the realised returns, the reference's form.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["METHODS", "OURS", "ESTIMATORS", "WeightHead", "sharpe", "portfolio_stats", "sum_residual",
           "selection_score"]

#: every trained method, in table order
METHODS = ("StemGNN", "StemGNN-KKThPINN", "StemGNN-CL", "ours", "ours-pathwise")
#: the Gaussian (ours) methods and their gradient estimators
ESTIMATORS = {"ours": "marginal_expectation", "ours-pathwise": "pathwise"}
OURS = tuple(ESTIMATORS)


def sharpe(weights: Tensor, returns: Tensor, *, rf: float = 0.03, days: int = 252, eps: float = 1e-12) -> Tensor:
    """Annualised Sharpe ratio of constant ``weights`` ``(..., B, N)`` over windows ``returns`` ``(B, H, N)``.

    Returns ``(..., B)``."""
    port = torch.einsum("...bn,bhn->...bh", weights, returns)
    mean = port.mean(-1)
    sd = port.std(-1, unbiased=True)
    return (days * mean - rf) / (math.sqrt(days) * sd + eps)


def portfolio_stats(weights: Tensor, returns: Tensor, *, rf: float = 0.03, days: int = 252) -> dict[str, Tensor]:
    """Per-window metrics of ``weights`` ``(B, N)`` on ``returns`` ``(B, H, N)``: ``sharpe``, ``ann_return``
    (252 x mean daily return), ``ann_vol`` (sqrt(252) x daily sd), ``short_share`` (fraction of weights < 0),
    ``sum_residual`` (``|sum(w) - 1|``), ``cum_return`` (``(B, H)`` compounded return within the window)."""
    port = torch.einsum("bn,bhn->bh", weights, returns)
    return {"sharpe": sharpe(weights, returns, rf=rf, days=days),
            "ann_return": days * port.mean(-1), "ann_vol": math.sqrt(days) * port.std(-1, unbiased=True),
            "short_share": (weights < 0).to(returns.dtype).mean(-1), "sum_residual": sum_residual(weights),
            "cum_return": torch.cumprod(1 + port, dim=-1) - 1}


def sum_residual(weights: Tensor) -> Tensor:
    """``|sum(w) - 1|`` per weight vector, ``(...,)``, computed in float64."""
    return (weights.to(torch.float64).sum(-1) - 1).abs()


class WeightHead:
    """Maps the weight head's raw outputs to portfolio weights for one method.

    Args:
        method: one of :data:`METHODS`.
        num_assets: ``N``.
        variance_floor: added to ``exp(s)`` (ours), in units of ``1 / N^2``.
        mc_samples: samples of the expected objective (ours, training).
    """

    def __init__(self, method: str, num_assets: int, *, variance_floor: float = 1e-6, mc_samples: int = 16) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}.")
        if int(num_assets) < 2:
            raise ValueError(f"num_assets must be >= 2, got {num_assets}.")
        if int(mc_samples) < 1:
            raise ValueError(f"mc_samples must be >= 1, got {mc_samples}.")
        self.method, self.N = method, int(num_assets)
        self.variance_floor, self.mc_samples = float(variance_floor), int(mc_samples)
        self.outputs = 2 if method in OURS else 1
        self._layers: dict[torch.dtype, object] = {}

    def _layer(self, dtype: torch.dtype, device: torch.device):
        from hardeq.baselines import ConstraintLayer, KKTProjection

        if dtype not in self._layers:
            A = torch.ones(1, self.N, dtype=dtype, device=device)
            k = torch.ones(1, dtype=dtype, device=device)
            cls = KKTProjection if self.method == "StemGNN-KKThPINN" else ConstraintLayer
            self._layers[dtype] = cls(A, k).to(device)
        return self._layers[dtype]

    def distribution(self, raw: Tensor):
        """``ConstrainedNormal`` of the ours methods for raw outputs ``(B, N, 2)``; batch ``(B,)``, event ``N``."""
        from hardeq import ConstrainedNormal, SumConstraint

        loc = (1 + raw[..., 0]) / self.N
        scale = torch.sqrt(torch.exp(raw[..., 1]) + self.variance_floor) / self.N
        index = torch.zeros(self.N, dtype=torch.long, device=raw.device)
        total = torch.ones(raw.shape[:-2] + (1,), dtype=raw.dtype, device=raw.device)
        return ConstrainedNormal(loc, scale, constraint=SumConstraint(index, total, validate_args=False),
                                 validate_args=False)

    def variances(self, raw: Tensor) -> Tensor:
        """Per-stock variances ``(exp(s) + floor) / N^2`` ``(B, N)`` of the ours head (before conditioning)."""
        return (torch.exp(raw[..., 1]) + self.variance_floor) / self.N**2

    def diagnostics(self, raw: Tensor) -> dict[str, Tensor]:
        r"""Per-window facts ``(B,)`` of the ours head that say whether it differs from a KKT projection.

        With per-stock variances :math:`v_i` and mean :math:`\mu`, the conditional mean given
        :math:`\sum w = 1` is :math:`\mu + v (1 - 1^\top\mu) / 1^\top v`; the orthogonal (KKT) projection of
        :math:`\mu` is :math:`\mu + (1 - 1^\top\mu) / N`. They coincide when all :math:`v_i` are equal.

        Returns ``var_cv`` (std / mean of ``v`` over stocks, population std), ``var_ratio`` (``max v / min v``)
        and ``gap_to_projection`` (``max_i |w_i - P(mu)_i|``, the largest distance of the conditional mean from
        the projection of the same mean). Cost ``O(B N)``."""
        if self.method not in OURS:
            raise ValueError(f"diagnostics are defined for the ours methods {list(OURS)}, got {self.method!r}.")
        v = self.variances(raw)
        loc = (1 + raw[..., 0]) / self.N
        projected = loc + (1 - loc.sum(-1, keepdim=True)) / self.N
        return {"var_cv": v.std(-1, unbiased=False) / v.mean(-1), "var_ratio": v.amax(-1) / v.amin(-1),
                "gap_to_projection": (self.weights(raw) - projected).abs().amax(-1)}

    def weights(self, raw: Tensor) -> Tensor:
        """Deterministic weights ``(B, N)`` from raw outputs ``(B, N, c)`` (ours: the conditional mean)."""
        if raw.dim() != 3 or raw.shape[1] != self.N or raw.shape[2] != self.outputs:
            raise ValueError(f"raw must be (B, {self.N}, {self.outputs}), got {tuple(raw.shape)}.")
        if self.method == "StemGNN":
            return torch.softmax(raw[..., 0], dim=-1)
        if self.method in OURS:
            return self.distribution(raw).mean
        return self._layer(raw.dtype, raw.device)((1 + raw[..., 0]) / self.N)

    def training_weights(self, raw: Tensor) -> Tensor:
        """Weights the training objective averages over: ``(S, B, N)`` exact samples carrying the method's
        gradient estimator for ours, ``(1, B, N)`` deterministic weights otherwise."""
        if self.method in OURS:
            q = self.distribution(raw)
            return q.rsample((self.mc_samples,), estimator=ESTIMATORS[self.method])
        return self.weights(raw).unsqueeze(0)


def selection_score(history: list[float], min_epochs: int, smooth: int) -> float:
    """The model-selection score after epoch ``len(history)`` (lower is better, as the trainer minimises it).

    ``history`` holds the mean validation Sharpe of every epoch so far. Before epoch ``min_epochs`` the score is
    NaN (never selected); from then on it is minus the mean of the last ``smooth`` validation Sharpe ratios, a
    trailing moving average that keeps a single lucky epoch from being selected. Requires
    ``1 <= smooth <= min_epochs``."""
    if not 1 <= int(smooth) <= int(min_epochs):
        raise ValueError(f"need 1 <= smooth <= min_epochs, got smooth={smooth}, min_epochs={min_epochs}.")
    if len(history) < min_epochs:
        return math.nan
    return -sum(history[-smooth:]) / smooth


def loss(head: WeightHead, forecast: Tensor, raw: Tensor, future: Tensor, returns: Tensor, *, w_pred: float,
         w_sharpe: float, rf: float = 0.03, days: int = 252) -> tuple[Tensor, dict[str, float]]:
    """``w_pred * MSE(forecast, future - 1) - w_sharpe * mean Sharpe`` of one batch.

    Args:
        forecast: ``(B, H, N)`` predicted relative prices minus 1; future: ``(B, H, N)`` true relative prices.
        raw: ``(B, N, c)`` weight-head outputs; returns: ``(B, H, N)`` realised daily returns.
    """
    mse = (forecast - (future - 1)).square().mean()
    sr = sharpe(head.training_weights(raw), returns, rf=rf, days=days).mean()
    return w_pred * mse - w_sharpe * sr, {"mse": float(mse.detach()), "sharpe": float(sr.detach())}

