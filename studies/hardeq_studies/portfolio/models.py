r"""StemGNN (Cao et al., "Spectral Temporal Graph Neural Network for Multivariate Time-series Forecasting",
NeurIPS 2020), written from the paper, with a price-forecast head and a portfolio-weight head per variant.

Shapes: ``B`` windows, ``T`` input days (window), ``H`` forecast days (horizon), ``N`` series (stocks),
``K`` Chebyshev orders, ``F = T // 2 + 1`` one-sided DFT frequencies, ``m`` the spectral cell's width factor.

* **Latent correlation layer** (paper Sec. 4.1): a GRU reads every series over time; its last hidden state
  ``R`` ``(B, N, d)`` gives queries and keys, and scaled dot-product self-attention
  :math:`W = \mathrm{softmax}(QK^\top/\sqrt d)` is the graph (one per window). Symmetrised,
  :math:`\tilde A = (W + W^\top)/2`, with normalised Laplacian :math:`L = I - D^{-1/2}\tilde A D^{-1/2}`.
* **Graph Fourier transform**: as in the official implementation, the GFT and spectral graph convolution use
  Chebyshev polynomials (as ChebNet) instead of an eigendecomposition; we apply :math:`T_k(\hat L) X`,
  :math:`k = 0..K-1`, of the rescaled Laplacian :math:`\hat L = L - I` (spectrum in ``[-1, 1]``), giving
  ``K`` graph-filtered copies of the input ``(B, K, N, T)``.
* **Spectral sequential cell**: ``torch.fft.rfft`` over time; real and imaginary parts each pass through
  three GLU layers (:math:`\mathrm{GLU}(x) = (xW_a + b_a) \odot \sigma(xW_b + b_b)`) over the ``K F``
  spectral features of every node; ``torch.fft.irfft`` back to ``T m`` time steps.
* **Graph convolution and inverse GFT**: a learned ``(T m, T m)`` kernel per Chebyshev order, summed over
  orders.
* **Blocks**: every block outputs a forecast :math:`\sigma(\cdot)` features ``(B, N, T)``; every block but the
  last also a backcast, :math:`\sigma(\mathrm{Lin}(\cdot) - \mathrm{Lin}(X))`, which is the next block's
  input. The forecasts of all blocks are summed.
* **Heads** (on the summed block outputs): price forecast ``Lin(T, T) -> LeakyReLU -> Lin(T, H)`` giving
  ``(B, H, N)``; weight head ``Lin(T, T) -> LeakyReLU -> Lin(T, c)`` giving ``c`` numbers per stock
  (``c = 2`` for the Gaussian head: mean and log-variance).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["GLU", "LatentCorrelation", "StemGNNBlock", "StemGNN", "chebyshev_filter"]


class GLU(nn.Module):
    """Gated linear unit ``(x W_a + b_a) * sigmoid(x W_b + b_b)``: ``(..., d_in) -> (..., d_out)``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.left = nn.Linear(d_in, d_out)
        self.right = nn.Linear(d_in, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.left(x) * torch.sigmoid(self.right(x))


class LatentCorrelation(nn.Module):
    """GRU over time per series, then scaled dot-product self-attention: ``(B, T, N) -> (B, N, N)``.

    The GRU reads each series in steps of ``chunk`` days (input size ``chunk``; ``chunk = 1`` is one day per
    step as in the paper; ``T`` must be a multiple of ``chunk``). Returns the attention matrix ``W`` (rows sum
    to 1; dropout applied in training)."""

    def __init__(self, hidden: int, dropout: float = 0.0, chunk: int = 1) -> None:
        super().__init__()
        self.chunk = chunk
        self.gru = nn.GRU(chunk, hidden, batch_first=True)
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.hidden = hidden

    def forward(self, x: Tensor) -> Tensor:
        B, T, N = x.shape
        if T % self.chunk:
            raise ValueError(f"window {T} must be a multiple of gru_chunk {self.chunk}.")
        seq = x.permute(0, 2, 1).reshape(B * N, T // self.chunk, self.chunk)
        _, h = self.gru(seq)  # (1, B N, d)
        R = h[-1].reshape(B, N, self.hidden)
        scores = self.query(R) @ self.key(R).transpose(-1, -2) / math.sqrt(self.hidden)
        return self.dropout(torch.softmax(scores, dim=-1))


def chebyshev_filter(attention: Tensor, x: Tensor, order: int) -> Tensor:
    r"""``(B, K, N, T)``: :math:`T_k(\hat L) x` for ``k < K = order``, :math:`\hat L = -D^{-1/2}\tilde A D^{-1/2}`
    (``= L - I``) with :math:`\tilde A` the symmetrised ``attention`` ``(B, N, N)``; ``x`` is ``(B, N, T)``."""
    A = 0.5 * (attention + attention.transpose(-1, -2))
    d = A.sum(-1).clamp_min(1e-12).rsqrt()  # (B, N)
    L_hat = -(d[:, :, None] * A * d[:, None, :])
    out = [x]
    if order > 1:
        out.append(L_hat @ x)
    for _ in range(2, order):
        out.append(2 * (L_hat @ out[-1]) - out[-2])
    return torch.stack(out, dim=1)


class StemGNNBlock(nn.Module):
    """One StemGNN block: GFT (Chebyshev) -> DFT -> GLUs -> IDFT -> graph convolution -> forecast/backcast.

    ``forward(x (B, N, T), attention (B, N, N)) -> (forecast (B, N, T), backcast (B, N, T) or None)``.
    """

    def __init__(self, time_steps: int, order: int, multi: int, backcast: bool, modes: int | None = None) -> None:
        super().__init__()
        T, K, m = time_steps, order, multi
        self.T, self.K, self.m = T, K, m
        self.F = T // 2 + 1 if modes is None else min(int(modes), T // 2 + 1)
        d = K * self.F
        self.glu_real = nn.Sequential(GLU(d, d * m), GLU(d * m, d * m), GLU(d * m, d * m))
        self.glu_imag = nn.Sequential(GLU(d, d * m), GLU(d * m, d * m), GLU(d * m, d * m))
        self.kernel = nn.Parameter(torch.empty(K, T * m, T * m))
        nn.init.xavier_normal_(self.kernel)
        self.forecast = nn.Linear(T * m, T * m)
        self.forecast_result = nn.Linear(T * m, T)
        self.backcast = nn.Linear(T * m, T) if backcast else None
        self.backcast_short_cut = nn.Linear(T, T) if backcast else None

    def spectral_cell(self, g: Tensor) -> Tensor:
        """``(B, K, N, T) -> (B, K, N, T m)``: DFT over time, GLUs on real and imaginary parts, inverse DFT
        (only the lowest ``F`` frequencies enter the GLUs when ``modes`` is set; the others are zero)."""
        B, K, N, T = g.shape
        spec = torch.fft.rfft(g, dim=-1)[..., : self.F]  # (B, K, N, F)
        real = spec.real.permute(0, 2, 1, 3).reshape(B, N, K * self.F)
        imag = spec.imag.permute(0, 2, 1, 3).reshape(B, N, K * self.F)
        real = self.glu_real(real).reshape(B, N, K, self.F * self.m).permute(0, 2, 1, 3)
        imag = self.glu_imag(imag).reshape(B, N, K, self.F * self.m).permute(0, 2, 1, 3)
        return torch.fft.irfft(torch.complex(real, imag), n=T * self.m, dim=-1)

    def forward(self, x: Tensor, attention: Tensor) -> tuple[Tensor, Tensor | None]:
        g = chebyshev_filter(attention, x, self.K)  # (B, K, N, T)
        cell = self.spectral_cell(g)  # (B, K, N, T m)
        conv = torch.einsum("bknt,kts->bns", cell, self.kernel)  # (B, N, T m)
        forecast = self.forecast_result(torch.sigmoid(self.forecast(conv)))
        if self.backcast is None:
            return forecast, None
        return forecast, torch.sigmoid(self.backcast(conv) - self.backcast_short_cut(x))


class StemGNN(nn.Module):
    """StemGNN with a price-forecast head and a weight head.

    Args:
        num_nodes: ``N`` (only checked against the input).
        window: ``T`` input days; horizon: ``H`` forecast days.
        stacks: number of StemGNN blocks (the paper: 2).
        order: Chebyshev orders ``K`` (the reference code: 4).
        multi: width factor ``m`` of the spectral cell (the reference code: 5).
        modes: lowest DFT frequencies the spectral cell keeps (``None``: all ``T // 2 + 1``).
        gru_hidden: ``d`` of the latent correlation layer.
        gru_chunk: days per GRU step (1: the paper's one day per step).
        dropout: on the attention matrix.
        weight_outputs: ``c`` outputs per stock of the weight head (1, or 2 for mean and log-variance).
        log_var_bias: with ``weight_outputs = 2``, add a learned per-stock bias ``b`` ``(N,)`` (initialised to 0
            here; the study draws it) to the second output, the log-variance. The network's features are
            nearly the same for every stock at initialisation, so without it every stock starts with the same
            variance.

    ``forward(x (B, T, N)) -> (forecast (B, H, N), weight_raw (B, N, c))``.
    """

    def __init__(self, num_nodes: int, window: int, horizon: int, *, stacks: int = 2, order: int = 4,
                 multi: int = 1, modes: int | None = None, gru_hidden: int = 16, gru_chunk: int = 1,
                 dropout: float = 0.5, weight_outputs: int = 1, leaky_slope: float = 0.2,
                 log_var_bias: bool = False) -> None:
        super().__init__()
        for arg, v, lo in (("num_nodes", num_nodes, 2), ("window", window, 2), ("horizon", horizon, 1),
                           ("stacks", stacks, 1), ("order", order, 1), ("multi", multi, 1),
                           ("gru_hidden", gru_hidden, 1), ("gru_chunk", gru_chunk, 1),
                           ("weight_outputs", weight_outputs, 1), ("modes", 1 if modes is None else modes, 1)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{arg} must be an integer >= {lo}, got {v!r}.")
        self.N, self.T, self.H = num_nodes, window, horizon
        if window % gru_chunk:
            raise ValueError(f"window ({window}) must be a multiple of gru_chunk ({gru_chunk}).")
        self.latent = LatentCorrelation(gru_hidden, dropout, gru_chunk)
        self.blocks = nn.ModuleList(StemGNNBlock(window, order, multi, backcast=i < stacks - 1, modes=modes)
                                    for i in range(stacks))
        self.fc = nn.Sequential(nn.Linear(window, window), nn.LeakyReLU(leaky_slope), nn.Linear(window, horizon))
        self.weight_head = nn.Sequential(nn.Linear(window, window), nn.LeakyReLU(leaky_slope),
                                         nn.Linear(window, weight_outputs))
        if log_var_bias and weight_outputs != 2:
            raise ValueError(f"log_var_bias needs weight_outputs = 2 (mean, log-variance), got {weight_outputs}.")
        self.log_var_bias = nn.Parameter(torch.zeros(num_nodes)) if log_var_bias else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.dim() != 3 or x.shape[1] != self.T or x.shape[2] != self.N:
            raise ValueError(f"x must be (B, {self.T}, {self.N}) (window, stocks), got {tuple(x.shape)}.")
        attention = self.latent(x)
        h = x.transpose(1, 2)  # (B, N, T)
        total = None
        for block in self.blocks:
            forecast, h_next = block(h, attention)
            total = forecast if total is None else total + forecast
            if h_next is not None:
                h = h_next
        raw = self.weight_head(total)
        if self.log_var_bias is not None:
            raw = torch.stack([raw[..., 0], raw[..., 1] + self.log_var_bias], dim=-1)
        return self.fc(total).transpose(1, 2), raw

