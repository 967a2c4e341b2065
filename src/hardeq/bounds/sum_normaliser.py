r"""The normaliser of one sum row with a diagonal covariance, by a 1-D convolution: exact up to a stated grid error.

For :math:`z \sim \mathcal N(\mu, \mathrm{diag}\,s^2)` given one row :math:`\sum_i w_i z_i = k` (a
:class:`~hardeq.LinearConstraint` with one row, or every group of a grouped sum, whose rows are independent) and the
box :math:`l \le z \le u`, write :math:`x_i = w_i z_i`: independent normals :math:`\mathcal N(m_i, \sigma_i^2)`,
:math:`m_i = w_i\mu_i`, :math:`\sigma_i = |w_i| s_i`, each boxed to :math:`[a_i, b_i]` (``w l`` and ``w u``, sorted),
with :math:`P_i` its box probability. By Bayes' rule for the sum :math:`S = \sum_i x_i`,

.. math::
    Z = P(\text{box} \mid S = k) = \prod_i P_i \cdot f_T(k) / f_S(k),

where :math:`f_S = \mathcal N(\sum m_i, V)`, :math:`V = \sum\sigma_i^2`, and :math:`f_T` is the density of
:math:`T = \sum_i X_i` with :math:`X_i` the *truncated* normals: a 1-D convolution. Coordinates outside the row
(:math:`w_i = 0`) contribute :math:`\log P_i` alone; a group of one coordinate (fixed by its row) contributes 0.

**Tilting** (Esscher). For any :math:`\theta`, tilting :math:`X_i` by :math:`e^{\theta x}` gives the truncated
normal of location :math:`m_i + \theta\sigma_i^2` on the same box, and
:math:`f_T(k) = \prod_i M_i(\theta)\, e^{-\theta k} f_{T_\theta}(k)`, so

.. math::
    \log Z = \sum_i \log P_i(\theta) + \frac{(\theta V - (k - \textstyle\sum_i m_i))^2}{2V}
    + \tfrac12\log(2\pi V) + \log f_{T_\theta}(k),

:math:`P_i(\theta) = \Phi(\beta_i - \theta\sigma_i) - \Phi(\alpha_i - \theta\sigma_i)` (:func:`log_diff_ndtr`).
This holds for every :math:`\theta`; :math:`\theta` is chosen (a bracketing search, sync-free) so that the tilted
mean :math:`\sum_i E_\theta X_i` is :math:`k`: the density is then read at the centre of :math:`T_\theta`'s law,
never in a tail, however small :math:`Z` is (tilts up to :data:`TILT_SHIFT_MAX` standard deviations).

**The convolution.** Each tilted :math:`X_i` is spread onto a grid of spacing :math:`h` by *linear binning*: the
mass of each cell goes to its two nodes in the proportions that keep the mean (closed forms from the normal CDF,
density and partial moments, in log space). The binned sum :math:`T_D` then has the law of
:math:`T_\theta + \sum_i R_i` with :math:`E[R_i \mid X_i] = 0` and known total variance
:math:`V_h = \sum_i E[(X_i - x^-)(x^+ - X_i)] \le n h^2/4`; its probability mass function is the product of the
components' FFTs (period :math:`2R`, :math:`R = \min(\sum_i (b_i - a_i),\ 12\sqrt{\sum_i\min(\sigma_i^2,
(b_i - a_i)^2/4)}) + |k - \sum_i E_\theta X_i|`: each :math:`X_i` is sub-Gaussian with variance proxy
:math:`\sigma_i^2` (log-concave relative to its normal) and :math:`(b_i - a_i)^2/4` (Hoeffding), so the wrapped mass
is below :math:`2e^{-72}`). The nodes are placed so that :math:`k` is a node, and
:math:`f_{T_\theta}(k) \approx p_0/h - \tfrac12 V_h f''`, :math:`f''` from the mass function's second difference
(the second-order correction of the binning noise, leaving :math:`O(h^3)` relative terms).

**Error bound.** :math:`h = 2R/N` with :math:`N` nodes, :data:`NODES_PER_ROOT` times the square root of the row's
size (a power of two): the binning variance is then at most about :math:`10^{-3}` of :math:`T_\theta`'s before the
correction. The reported error is :math:`|\log\hat Z_h - \log\hat Z_{2h}|`, the difference from the same estimate
on half the nodes: with an error of order :math:`h^2` or smaller, it bounds the error of :math:`\hat Z_h` (by
about 4x). It is what :attr:`~hardeq.TruncatedConstrainedNormal.log_normaliser_stderr` reports on this path.

**Gradient.** Autograd through the closed forms, the binning weights and the FFT (:math:`\theta` and the nodes are
held fixed, which the identity above allows); ``k``'s part through :math:`f'_{T_\theta}(k)` from the mass function's
central difference. Exact for the discretised estimate, so the gradient carries the same grid error.

Cost: ``N log N`` per coordinate of the row (an FFT), in float64, in chunks of the batch that bound memory by
:data:`CHUNK_ELEMENTS`; the row's size times ``N`` is at most :data:`GRID_ELEMENTS_MAX` (otherwise the path does not
apply and the Monte Carlo normaliser is used). No host read, except one for the group sizes of a grouped sum of
more than one group (once per distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .normaliser import _standardized, log_diff_ndtr
from .target import PlaneTarget

__all__ = ["SumRowLayout", "sum_row_layout", "sum_row_log_normaliser", "NODES_PER_ROOT", "GRID_ELEMENTS_MAX",
           "CHUNK_ELEMENTS", "TILT_SHIFT_MAX"]

#: grid nodes per square root of the row's size (then the next power of two, at least 1,024)
NODES_PER_ROOT = 540
#: largest (coordinates in the row) x (grid nodes) per batch element for which the path applies (4M: rows of up to
#: 256 coordinates; one batch element's working arrays then stay near 32 MiB each)
GRID_ELEMENTS_MAX = 1 << 22
#: elements of the working arrays per chunk of the batch
CHUNK_ELEMENTS = 1 << 21
#: largest tilt, in standard deviations of a coordinate
TILT_SHIFT_MAX = 1e4
#: the tail of the sum kept by the grid, in sub-Gaussian standard deviations
TAIL = 12.0
_CANDIDATES, _ROUNDS, _U = 256, 3, 20.0
_F64 = torch.float64
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class SumRowLayout:
    """Where :func:`sum_row_log_normaliser` applies: the row weights and the coordinates of every group.

    Attributes:
        weights (Tensor): ``(*batch_A, n)`` float64 row coefficients (0: in no row).
        slots (Tensor): ``(G, m)`` long, the coordinates of each group (``n`` pads a group shorter than ``m``).
        nodes (int): grid nodes ``N`` (a power of two).
    """

    weights: Tensor
    slots: Tensor
    nodes: int


def sum_row_layout(dist: object) -> SumRowLayout | None:
    """The layout of ``dist`` (a :class:`PlaneTarget` or a ``ConstrainedNormal``) when its covariance is diagonal and
    its constraint is one row or a grouped sum, and the grid fits :data:`GRID_ELEMENTS_MAX`; else ``None``. One host
    read for a grouped sum of two or more groups (its group sizes)."""
    target = PlaneTarget.of(dist)
    con, n = target.constraint, target.event_size
    if not target.covariance.is_diagonal:
        return None
    index = con.group_index
    device = target.loc.device
    if index is not None and con.num_constraints > 1:
        idx = index.detach().cpu()
        sizes = torch.bincount(idx, minlength=con.num_constraints)
        m = int(sizes.max())
        order = torch.argsort(idx, stable=True)
        starts = torch.cumsum(sizes, 0) - sizes
        pos = torch.arange(n) - starts[idx[order]]
        slots = torch.full((con.num_constraints, m), n, dtype=torch.long)
        slots[idx[order], pos] = order
        weights = torch.ones(n, dtype=_F64, device=device)
    elif con.num_constraints == 1:
        m = n
        slots = torch.arange(n).unsqueeze(0)
        weights = torch.ones(n, dtype=_F64, device=device) if index is not None \
            else con.dense_rows()[..., 0, :].to(_F64)
    else:
        return None
    nodes = max(1024, 1 << math.ceil(math.log2(NODES_PER_ROOT * math.sqrt(max(m, 1)))))
    if m * nodes > GRID_ELEMENTS_MAX:
        return None
    return SumRowLayout(weights, slots.to(device), nodes)


def _log_phi(u: Tensor) -> Tensor:
    return -0.5 * u * u - _LOG_SQRT_2PI


def _tilted_mean(m: Tensor, s: Tensor, al: Tensor, be: Tensor, theta: Tensor) -> Tensor:
    """``E_theta X`` of the truncated normals (``m``, ``s``, standardized box ``al``, ``be``) tilted by ``theta``."""
    a, b = al - theta * s, be - theta * s
    log_p = log_diff_ndtr(a, b)
    lam = torch.exp(_log_phi(a) - log_p) - torch.exp(_log_phi(b) - log_p)
    return m + theta * s * s + s * lam


@torch.no_grad()
def _tilt(m: Tensor, s: Tensor, al: Tensor, be: Tensor, valid: Tensor, k: Tensor) -> Tensor:
    r"""``(r, G)``: :math:`\theta` with :math:`\sum_i E_\theta X_i \approx k` (the sum is increasing in
    :math:`\theta`), by :data:`_ROUNDS` rounds of :data:`_CANDIDATES` candidates on
    :math:`\theta = \theta_{\max}\sinh(u)/\sinh(20)`, :math:`\theta_{\max} = ` :data:`TILT_SHIFT_MAX` / max sigma."""
    theta_max = TILT_SHIFT_MAX / torch.where(valid, s, torch.zeros_like(s)).amax(-1).clamp_min(1e-300)  # (r, G)
    scale = theta_max / math.sinh(_U)
    lo = torch.full_like(k, -_U)
    hi = torch.full_like(k, _U)
    steps = torch.linspace(0.0, 1.0, _CANDIDATES, dtype=_F64, device=k.device)
    for _ in range(_ROUNDS):
        u = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * steps  # (r, G, C)
        theta = (scale.unsqueeze(-1) * torch.sinh(u)).unsqueeze(-1)  # (r, G, C, 1)
        mean = _tilted_mean(m.unsqueeze(-2), s.unsqueeze(-2), al.unsqueeze(-2), be.unsqueeze(-2), theta)
        g = torch.where(valid.unsqueeze(-2), mean, torch.zeros_like(mean)).sum(-1) - k.unsqueeze(-1)  # (r, G, C)
        below = (g < 0).sum(-1, keepdim=True)  # candidates below k: the root lies after the last of them
        i_hi = below.clamp(1, _CANDIDATES - 1)
        lo = u.gather(-1, i_hi - 1).squeeze(-1)
        hi = u.gather(-1, i_hi).squeeze(-1)
    return scale * torch.sinh(0.5 * (lo + hi))


def _binned_fft(nu: Tensor, s: Tensor, a: Tensor, b: Tensor, log_p: Tensor, origin: Tensor, h: Tensor, nodes: int
                ) -> tuple[Tensor, Tensor]:
    r"""The FFT ``(r, G, m, N/2 + 1)`` of each tilted component's linear binning on the nodes
    ``origin + i h`` (``i`` mod ``N``, node 0 at ``origin``) and its binning variance ``(r, G, m)`` in units of
    :math:`h^2` (detached). ``a``, ``b``: the standardized tilted box; ``log_p``: its log probability."""
    half = nodes // 2
    i = torch.arange(-half, half + 1, dtype=_F64, device=nu.device)
    x = origin.unsqueeze(-1) + i * h.unsqueeze(-1).unsqueeze(-1)  # (r, G, m, N + 1) boundaries, fixed
    u = torch.minimum(torch.maximum((x - nu.unsqueeze(-1)) / s.unsqueeze(-1), a.unsqueeze(-1)), b.unsqueeze(-1))
    c, d = u[..., :-1], u[..., 1:]
    lp = log_p.unsqueeze(-1)
    mass = torch.exp(log_diff_ndtr(c, d) - lp)
    phi_c, phi_d = torch.exp(_log_phi(c) - lp), torch.exp(_log_phi(d) - lp)
    sh = (s / h.unsqueeze(-1)).unsqueeze(-1)
    off = (nu.unsqueeze(-1) - x[..., :-1]) / h.unsqueeze(-1).unsqueeze(-1)  # (nu - left node) / h
    first = sh * (phi_c - phi_d) + off * mass  # E[(X - left) / h; cell]
    weights = torch.nn.functional.pad(mass - first, (0, 1)) + torch.nn.functional.pad(first, (1, 0))
    circular = torch.cat([weights[..., :1] + weights[..., -1:], weights[..., 1:-1]], -1)  # node -N/2 == N/2
    circular = torch.roll(circular, shifts=-half, dims=-1)  # index 0 = node 0
    with torch.no_grad():
        uc = torch.where(torch.isfinite(c), c * phi_c, torch.zeros_like(c))
        ud = torch.where(torch.isfinite(d), d * phi_d, torch.zeros_like(d))
        second = sh * sh * (mass + uc - ud) + 2 * sh * off * (phi_c - phi_d) + off * off * mass
        spread = (first - second).sum(-1)
    return torch.fft.rfft(circular, dim=-1), spread


def _log_density(nu: Tensor, s: Tensor, a: Tensor, b: Tensor, log_p: Tensor, valid: Tensor, origin: Tensor,
                 half_period: Tensor, nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(log f, f'/f, grid ok)`` at ``sum(origin) = k`` of the tilted sum on ``nodes`` nodes, ``(r, G)``."""
    h = (2 * half_period / nodes).detach()
    spectrum, spread = _binned_fft(nu, s, a, b, log_p, origin, h, nodes)
    one = torch.ones_like(spectrum)
    pmf = torch.fft.irfft(torch.where(valid.unsqueeze(-1), spectrum, one).prod(-2), n=nodes, dim=-1)  # (r, G, N)
    p0, p1, pm1 = pmf[..., 0], pmf[..., 1], pmf[..., -1]
    v_bin = (torch.where(valid, spread, torch.zeros_like(spread)).sum(-1) * h * h).detach()
    f = p0 / h - 0.5 * v_bin * (p1 - 2 * p0 + pm1) / h ** 3
    ok = f > 0
    f_safe = torch.where(ok, f, torch.ones_like(f))
    slope = ((p1 - pm1) / (2 * h * h) / f_safe).detach()
    return torch.log(f_safe), slope, ok


def _chunk(m: Tensor, s: Tensor, al: Tensor, be: Tensor, valid: Tensor, k: Tensor, nodes: int
           ) -> tuple[Tensor, Tensor]:
    """``(log Z, error)`` ``(r, G)`` of the groups of one chunk of the batch (module docstring)."""
    count = valid.sum(-1)
    zero = torch.zeros_like(m)
    m, s = torch.where(valid, m, zero), torch.where(valid, s, torch.ones_like(s))
    with torch.no_grad():  # a group of one (or none) contributes 0: read it at its own mean, kept finite
        own = torch.where(valid, _tilted_mean(m, s, al, be, torch.zeros_like(m)), zero).sum(-1)
    k_eff = torch.where(count >= 2, k, own)
    theta = _tilt(m.detach(), s.detach(), al.detach(), be.detach(), valid, k_eff.detach()).unsqueeze(-1)
    # an infinite end stays a constant (no path from it to s: log_ndtr's derivative at -inf is NaN)
    a = torch.where(torch.isfinite(al), al - theta * s, al)
    b = torch.where(torch.isfinite(be), be - theta * s, be)
    log_p = log_diff_ndtr(a, b)
    nu = m + theta * s * s
    var = torch.where(valid, s * s, zero).sum(-1)
    var_safe = torch.where(var > 0, var, torch.ones_like(var))
    total = torch.where(valid, m, zero).sum(-1)
    explicit = (torch.where(valid, log_p, zero).sum(-1)
                + (theta.squeeze(-1) * var_safe - (k_eff - total)) ** 2 / (2 * var_safe)
                + 0.5 * torch.log(2 * math.pi * var_safe))
    with torch.no_grad():
        mean = torch.where(valid, _tilted_mean(m, s, al, be, theta), zero)
        gap = k_eff - mean.sum(-1)
        width = torch.where(valid, (b - a) * s, zero)
        proxy = torch.where(valid, torch.minimum(s * s, width * width / 4), zero).sum(-1).sqrt()
        half_period = torch.minimum(width.sum(-1), TAIL * proxy) + gap.abs()
        half_period = torch.where(half_period > 0, half_period, torch.ones_like(half_period))
        origin = mean + torch.where(valid, gap.unsqueeze(-1) / count.clamp_min(1).unsqueeze(-1), zero)
    log_f, slope, ok = _log_density(nu, s, a, b, log_p, valid, origin, half_period, nodes)
    with torch.no_grad():
        log_f2, _, ok2 = _log_density(nu, s, a, b, log_p, valid, origin, half_period, nodes // 2)
    k_part = (k_eff - k_eff.detach()) * slope
    log_z = explicit + log_f + k_part
    error = torch.where(ok & ok2, (log_f - log_f2).abs().detach(), torch.full_like(log_f, math.inf))
    single = count < 2
    return torch.where(single, torch.zeros_like(log_z), log_z), torch.where(single, torch.zeros_like(error), error)


def sum_row_log_normaliser(dist: object, lower: Tensor, upper: Tensor, layout: SumRowLayout
                           ) -> tuple[Tensor, Tensor]:
    r"""``(log Z, error)``, each ``batch_shape`` float64: :math:`\log P(l \le z \le u \mid \text{rows})` of one sum row
    (or each group of a grouped sum) with a diagonal covariance (module docstring), differentiable in ``loc``, the
    scales, ``k`` and the bounds, and its grid error estimate :math:`|\log\hat Z_h - \log\hat Z_{2h}|` (``inf`` where
    the grid failed: the caller then uses another normaliser). ``layout`` from :func:`sum_row_layout`.

    Examples:
        >>> import math, torch, hardeq
        >>> from hardeq.bounds.sum_normaliser import sum_row_layout, sum_row_log_normaliser
        >>> total = hardeq.SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1, dtype=torch.float64))
        >>> d = hardeq.ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 5.0, constraint=total)
        >>> lo, hi = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        >>> log_z, err = sum_row_log_normaliser(d, lo, hi, sum_row_layout(d))
        >>> # sd 5 on a unit box, nearly uniform: Z ~ P(box) f_{U1+U2+U3}(1) / f_S(1), with P(box) ~ (5 sqrt(2 pi))^-3,
        >>> # the sum of three uniforms at 1 has density 1/2, and S ~ N(0, 75)
        >>> approx = math.log((5 * math.sqrt(2 * math.pi)) ** -3 * 0.5 * math.sqrt(2 * math.pi * 75))
        >>> round(float(log_z), 2), round(approx, 2), float(err) < 1e-4
        (-5.2, -5.2, True)
    """
    target = PlaneTarget.of(dist)
    batch, n = target.batch_shape, target.event_size
    shape = batch + (n,)
    loc = target.loc.to(_F64).expand(shape)
    sd = target.covariance.variance.to(_F64).expand(shape).sqrt()
    lo, hi = lower.to(_F64).expand(shape), upper.to(_F64).expand(shape)
    w = layout.weights.to(loc.device).expand(shape)
    in_row = w != 0
    w_safe = torch.where(in_row, w, torch.ones_like(w))
    m, s = w_safe * loc, w_safe.abs() * sd
    z_lo, z_hi = _standardized(lo, loc, sd), _standardized(hi, loc, sd)  # +-inf kept out of the gradient
    positive = w_safe > 0
    al, be = torch.where(positive, z_lo, -z_hi), torch.where(positive, z_hi, -z_lo)
    free = torch.where(in_row, torch.zeros_like(loc), log_diff_ndtr(z_lo, z_hi)).sum(-1)
    slots = layout.slots
    G, size = slots.shape

    def gather(t: Tensor, pad: float) -> Tensor:  # (B, n) -> (B, G, m), padded slots = pad
        t = torch.cat([t, torch.full_like(t[..., :1], pad)], -1)
        return t[..., slots.reshape(-1)].reshape(t.shape[:-1] + (G, size))

    B = batch.numel()
    flat = [t.reshape(B, n) for t in (m, s, al, be)]
    cols = [gather(flat[0], 0.0), gather(flat[1], 1.0), gather(flat[2], -math.inf), gather(flat[3], math.inf)]
    valid = gather(in_row.reshape(B, n).to(_F64), 0.0) > 0
    k = target.constraint.k.to(_F64).expand(batch + (G,)).reshape(B, G)
    rows = max(1, CHUNK_ELEMENTS // max(1, G * size * layout.nodes))
    parts = [_chunk(cols[0][i: i + rows], cols[1][i: i + rows], cols[2][i: i + rows], cols[3][i: i + rows],
                    valid[i: i + rows], k[i: i + rows], layout.nodes) for i in range(0, B, rows)]
    log_z = torch.cat([p[0] for p in parts]).sum(-1).reshape(batch) + free
    error = torch.cat([p[1] for p in parts]).sum(-1).reshape(batch)
    return log_z, error
