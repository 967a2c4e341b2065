r"""Convergence diagnostics of Markov chains: effective sample size and split :math:`\hat R`.

Both take ``samples`` of shape ``(draws, chains, *event)`` and return one value per entry of ``*event``.
They follow Stan's definitions (Vehtari, Gelman, Simpson, Carpenter and Bürkner 2021, *Rank-normalization,
folding, and localization: an improved R-hat*, without the rank normalisation; Geyer 1992 for the initial
monotone sequence), vectorised over the event dimensions in float64.

A coordinate whose draws are all identical (a coordinate fixed by the constraint, or pinned at a bound) is known
exactly from any one draw: its effective sample size is the number of draws ``draws * chains`` and its
:math:`\hat R` is 1, rather than ``nan``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["effective_sample_size", "split_rhat"]


def _check(samples: object, name: str, min_draws: int) -> Tensor:
    if not isinstance(samples, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (draws, chains, ...), got {type(samples).__name__}.")
    if samples.dim() < 2:
        raise ValueError(f"{name} must have shape (draws, chains, ...) (at least 2 dimensions), got shape "
                         f"{tuple(samples.shape)}.")
    if samples.shape[0] < min_draws:
        raise ValueError(f"{name} needs at least {min_draws} draws per chain (dimension 0), got "
                         f"{samples.shape[0]} (shape {tuple(samples.shape)}).")
    if samples.shape[1] < 1:
        raise ValueError(f"{name} needs at least one chain (dimension 1), got shape {tuple(samples.shape)}.")
    if not (samples.is_floating_point()):
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {samples.dtype}.")
    if not bool(torch.isfinite(samples).all()):
        raise ValueError(f"{name} contains non-finite values (nan or inf); the diagnostics need finite draws.")
    return samples.detach().to(torch.float64)


def _autocovariance(x: Tensor) -> Tensor:
    r"""Biased autocovariance along dimension 0 of ``x`` ``(N, ...)``: :math:`\gamma_t = \frac1N\sum_{s<N-t}
    (x_s - \bar x)(x_{s+t} - \bar x)`, ``(N, ...)``, by FFT (O(N log N) per series)."""
    N = x.shape[0]
    centred = x - x.mean(0, keepdim=True)
    size = 1 << (2 * N - 1).bit_length()
    f = torch.fft.rfft(centred, n=size, dim=0)
    gamma: Tensor = torch.fft.irfft(f * f.conj(), n=size, dim=0)[:N] / N
    return gamma


def effective_sample_size(samples: Tensor) -> Tensor:
    r"""Multi-chain effective sample size of each coordinate, ``(draws, chains, *event) -> (*event)`` (float64).

    With :math:`M` chains of :math:`N` draws, per-chain autocovariances :math:`\gamma_{m,t}` (by FFT), the mean
    within-chain variance :math:`W`, and :math:`\widehat{\mathrm{var}}^+ = \frac{N-1}{N}W + B/N` (:math:`B/N`: the
    variance of the chain means; 0 for one chain), the combined autocorrelation is

    .. math:: \hat\rho_t = 1 - \frac{W - \frac1M\sum_m \gamma_{m,t}}{\widehat{\mathrm{var}}^+},

    summed with Geyer's initial monotone sequence: pairs :math:`P_k = \hat\rho_{2k} + \hat\rho_{2k+1}` up to the
    first negative pair, made non-increasing, and :math:`\hat\tau = -1 + 2\sum_k P_k`,
    :math:`\mathrm{ESS} = MN/\hat\tau` (with :math:`\hat\tau \ge 1/\log_{10}(MN)`, as Stan, so antithetic
    chains can exceed :math:`MN` only that far). For :math:`N` independent draws per chain, ESS :math:`\approx
    MN`; for AR(1) chains with coefficient :math:`\rho`, :math:`\approx MN(1-\rho)/(1+\rho)`.

    Cost: O(M N log N) per coordinate; memory about four float64 copies of the samples.

    Args:
        samples: ``(draws, chains, *event)``, at least 4 draws, finite.

    Returns:
        ``(*event)`` float64; a constant coordinate gets ``draws * chains`` (see the module docstring).

    Examples:
        >>> from hardeq.bounds import effective_sample_size
        >>> draws = torch.randn(1000, 4, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> ess = effective_sample_size(draws)  # independent draws: about 4 chains x 1000
        >>> ess.shape, bool(((ess > 3000) & (ess < 5000)).all())
        (torch.Size([2]), True)
        >>> effective_sample_size(torch.ones(10, 2, 1))  # a constant coordinate: draws x chains
        tensor([20.], dtype=torch.float64)
    """
    return ess_unchecked(_check(samples, "samples", 4))


def ess_unchecked(x: Tensor) -> Tensor:
    """:func:`effective_sample_size` of ``x`` ``(draws >= 4, chains, *event)`` float64, known finite (a sampler's own
    draws): no argument check, so no host read."""
    N, M = x.shape[0], x.shape[1]
    acov = _autocovariance(x)                                  # (N, M, ...)
    chain_mean = x.mean(0)                                     # (M, ...)
    chain_var = acov[0] * N / (N - 1)
    W = chain_var.mean(0)                                      # (...)
    between = chain_mean.var(0, unbiased=True) if M > 1 else torch.zeros_like(W)
    var_plus = W * (N - 1) / N + between
    constant = var_plus <= 0
    safe = torch.where(constant, torch.ones_like(var_plus), var_plus)
    rho = 1.0 - (W - acov.mean(1)) / safe                      # (N, ...)
    rho[0] = 1.0
    K = N // 2
    pairs = rho[: 2 * K : 2] + rho[1 : 2 * K : 2]              # (K, ...)
    positive = (pairs > 0).to(torch.int64).cumprod(0).bool()   # the initial positive sequence
    monotone = torch.cummin(torch.where(positive, pairs, torch.full_like(pairs, math.inf)), 0).values
    tau = -1.0 + 2.0 * torch.where(positive, monotone, torch.zeros_like(pairs)).sum(0)
    total = float(N * M)
    tau = tau.clamp_min(1.0 / math.log10(total))
    ess = total / tau
    return torch.where(constant, torch.full_like(ess, total), ess)


def split_rhat(samples: Tensor) -> Tensor:
    r"""Split :math:`\hat R` of each coordinate, ``(draws, chains, *event) -> (*event)`` (float64).

    Each chain is cut into its first and second half (the middle draw dropped when ``draws`` is odd), giving
    :math:`M' = 2M` chains of :math:`N' = \lfloor N/2\rfloor` draws; with :math:`W` the mean of their variances and
    :math:`B/N'` the variance of their means,

    .. math:: \hat R = \sqrt{\frac{\frac{N'-1}{N'}W + B/N'}{W}}.

    Near 1 for chains that have mixed (below 1.01 is Stan's current advice); well above 1 when the chains, or
    the halves of one chain, disagree. Cost: O(M N) per coordinate.

    Args:
        samples: ``(draws, chains, *event)``, at least 4 draws, finite.

    Returns:
        ``(*event)`` float64; 1 for a constant coordinate, ``inf`` when every split chain is constant but they
        differ.

    Examples:
        >>> from hardeq.bounds import split_rhat
        >>> draws = torch.randn(1000, 4, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> bool(split_rhat(draws) < 1.01)  # chains that agree
        True
        >>> draws[:, 2:] += 3.0  # two chains sit elsewhere
        >>> bool(split_rhat(draws) > 1.5)
        True
    """
    return rhat_unchecked(_check(samples, "samples", 4))


def rhat_unchecked(x: Tensor) -> Tensor:
    """:func:`split_rhat` of ``x`` ``(draws >= 4, chains, *event)`` float64, known finite (a sampler's own draws): no
    argument check, so no host read."""
    half = x.shape[0] // 2
    split = torch.cat([x[:half], x[x.shape[0] - half:]], dim=1)   # (N', 2M, ...)
    W = split.var(0, unbiased=True).mean(0)
    between = split.mean(0).var(0, unbiased=True)
    var_plus = W * (half - 1) / half + between
    rhat = torch.sqrt(var_plus / W)
    rhat = torch.where(W > 0, rhat, torch.where(between > 0, torch.full_like(W, math.inf), torch.ones_like(W)))
    return rhat
