r"""The three VAE architectures of the ``vae-data`` study (paper, Table 2 / appendix C) on MNIST images
flattened to 784 pixels in ``[0, 1]`` with a Gaussian observation model.

* :class:`VAE` -- one Gaussian latent of 64 dimensions, standard normal prior, analytic KL.
* :class:`LadderVAE` -- Sønderby et al. (NeurIPS 2016): three latent layers of 64, 32, 16 dimensions read off
  the encoder trunk at widths 512, 256, 128, a top-down generative path and the precision-weighted merge of the
  bottom-up and top-down Gaussians (their eq. 17-19); per-layer analytic KLs at the sampled parents.
* :class:`GraphVAE` -- He et al. (ICLR 2019): 4 latent nodes of 16 dimensions, a DAG over the node order with
  learned gates :math:`c_{ij} \in (0, 1)`, :math:`i < j`; same posterior structure as the Ladder VAE.

Shared pieces (appendix C), with ``hidden = (h0, h1, h2, h3) = (512, 512, 256, 128)``:

* encoder trunk ``fc(784,h0)-BN-ELU-fc(h0,h1)-BN-ELU-fc(h1,h2)-BN-ELU-fc(h2,h3)``;
* decoder ``fc(latent,h3)-BN-ELU-fc(h3,h2)-BN-ELU-fc(h2,h1)-BN-ELU-fc(h1,h0)-BN-ELU-fc(h0,784)`` giving the
  pre-activations :math:`h \in \mathbb R^{784}`; observation :math:`p(x \mid z) = \mathcal N(\mathrm{sigmoid}(h),
  \mathrm{diag}\, e^{v})`, :math:`v = \mathrm{softclamp}(\mathrm{fc}(784,784)(h), -12, 6)` (``observation =
  "diagonal"``, appendix C), or :math:`v = \mathrm{softclamp}(\nu, -12, 6)` for every pixel with one learned scalar
  :math:`\nu` (``observation = "homoscedastic"``, initialised at 0: unit variance).

All log-variances (latent and observed) go through a smooth clamp
:math:`\mathrm{softclamp}(u, a, b) = a + \mathrm{softplus}(u - a) - \mathrm{softplus}(u - b) \in (a, b)`, which is
the identity up to ~1e-3 well inside the range and never kills a gradient. Latent log-variances live in
``[-10, 6]``.

Interface (the training loop of the study depends on it): ``forward(x) -> (mean, log_var, kl)`` for one
reparameterised sample :math:`z \sim q(z \mid x)` (train mode, global RNG), and
``importance(x, K, generator) -> (mean, log_var, log_ratio)`` for ``K`` samples drawn with ``generator`` only,
vectorised over ``K`` (call it in eval mode), with ``log_ratio = log p(z_k) - log q(z_k | x)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["VAE", "LadderVAE", "GraphVAE", "MODELS", "OBSERVATIONS", "PIXELS"]

PIXELS = 784
HIDDEN = (512, 512, 256, 128)
OBS_LOG_VAR = (-12.0, 6.0)
#: observation models: a per-pixel log-variance head (appendix C) or one learned variance for every pixel
OBSERVATIONS = ("diagonal", "homoscedastic")
LATENT_LOG_VAR = (-10.0, 6.0)
_LOG_2PI = math.log(2 * math.pi)


# ----------------------------------------------------------------------------------------------- helpers
def _soft_clamp(u: Tensor, lo: float, hi: float) -> Tensor:
    return lo + F.softplus(u - lo) - F.softplus(u - hi)


def _mlp(sizes: tuple[int, ...] | list[int]) -> nn.Sequential:
    """``fc-BN-ELU`` between consecutive sizes, the last layer a plain ``fc``."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers += [nn.BatchNorm1d(b), nn.ELU()]
    return nn.Sequential(*layers)


def _apply(module: nn.Module, x: Tensor) -> Tensor:
    """Apply a module built for ``(N, F)`` inputs (BatchNorm1d) to ``(..., F)``."""
    if x.dim() == 2:
        return module(x)
    out = module(x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _gaussian(h: Tensor) -> tuple[Tensor, Tensor]:
    """``(..., 2d)`` head output -> mean and (soft-clamped) log-variance, each ``(..., d)``."""
    mu, lv = h.chunk(2, dim=-1)
    return mu, _soft_clamp(lv, *LATENT_LOG_VAR)


def _merge(mu_a: Tensor, lv_a: Tensor, mu_b: Tensor, lv_b: Tensor) -> tuple[Tensor, Tensor]:
    r"""Precision-weighted product of two diagonal Gaussians (Sønderby et al. eq. 17-19):
    :math:`\sigma^2 = (\sigma_a^{-2} + \sigma_b^{-2})^{-1}`,
    :math:`\mu = (\mu_a\sigma_a^{-2} + \mu_b\sigma_b^{-2})\,\sigma^2`; written with
    :math:`w_a = \sigma^2/\sigma_a^2 = \mathrm{sigmoid}(\log\sigma_b^2 - \log\sigma_a^2)` for stability."""
    w = torch.sigmoid(lv_b - lv_a)
    return w * mu_a + (1 - w) * mu_b, -torch.logaddexp(-lv_a, -lv_b)


def _log_normal(z: Tensor, mu: Tensor, lv: Tensor) -> Tensor:
    """:math:`\\sum_d \\log \\mathcal N(z_d; \\mu_d, e^{lv_d})`, summed over the last dimension."""
    return -0.5 * (_LOG_2PI + lv + (z - mu).square() * torch.exp(-lv)).sum(-1)


def _kl(mu_q: Tensor, lv_q: Tensor, mu_p: Tensor | float, lv_p: Tensor | float) -> Tensor:
    """Analytic :math:`\\mathrm{KL}(\\mathcal N(\\mu_q, e^{lv_q}) \\Vert \\mathcal N(\\mu_p, e^{lv_p}))`, summed
    over the last dimension."""
    lv_p = torch.as_tensor(lv_p, dtype=lv_q.dtype, device=lv_q.device)
    return 0.5 * (lv_p - lv_q + (torch.exp(lv_q) + (mu_q - mu_p).square()) * torch.exp(-lv_p) - 1).sum(-1)


class _Sample:
    """One latent layer sampled by reparameterisation, with its KL and log-ratio contributions."""

    @staticmethod
    def draw(mu_q: Tensor, lv_q: Tensor, mu_p: Tensor | float, lv_p: Tensor | float, eps: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
        """-> ``z = mu_q + exp(lv_q / 2) eps``, analytic ``KL(q || p)`` and ``log p(z) - log q(z)``."""
        z = mu_q + torch.exp(0.5 * lv_q) * eps
        log_q = -0.5 * (_LOG_2PI + lv_q + eps.square()).sum(-1)
        if isinstance(mu_p, float):
            mu_p = torch.full_like(z, mu_p)
        if isinstance(lv_p, float):
            lv_p = torch.full_like(z, lv_p)
        return z, _kl(mu_q, lv_q, mu_p, lv_p), _log_normal(z, mu_p, lv_p) - log_q


def _noise(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=like.dtype, device=like.device)


class _Decoder(nn.Module):
    r"""``z (..., latent) -> (mean (..., 784), log_var (..., 784))``: the mirrored trunk
    ``fc(latent,h3)-BN-ELU-fc(h3,h2)-BN-ELU-fc(h2,h1)-BN-ELU-fc(h1,h0)-BN-ELU-fc(h0,784)`` gives :math:`h`;
    mean :math:`\mathrm{sigmoid}(h)`; log-variance :math:`\mathrm{softclamp}(\mathrm{fc}(784,784)(h), -12, 6)`
    (``"diagonal"``) or one learned scalar :math:`\mathrm{softclamp}(\nu, -12, 6)` broadcast to every pixel
    (``"homoscedastic"``; 784 x 785 fewer parameters)."""

    def __init__(self, latent: int, hidden: tuple[int, ...], observation: str = "diagonal"):
        super().__init__()
        if observation not in OBSERVATIONS:
            raise ValueError(f"observation must be one of {OBSERVATIONS}, got {observation!r}.")
        self.net = _mlp([latent, *reversed(hidden), PIXELS])
        self.observation = observation
        self.log_var = nn.Linear(PIXELS, PIXELS) if observation == "diagonal" else nn.Parameter(torch.zeros(1))

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        h = _apply(self.net, z)
        mean = torch.sigmoid(h)
        if self.observation == "diagonal":
            return mean, _soft_clamp(self.log_var(h), *OBS_LOG_VAR)
        return mean, _soft_clamp(self.log_var, *OBS_LOG_VAR).expand_as(mean)


def _check_hidden(hidden: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    hidden = tuple(int(h) for h in hidden)
    if len(hidden) != 4 or min(hidden) < 1:
        raise ValueError(f"hidden must be 4 positive widths (h0, h1, h2, h3), got {hidden}.")
    return hidden


# ----------------------------------------------------------------------------------------------- VAE
class VAE(nn.Module):
    r"""The plain VAE of appendix C.

    Encoder ``fc(784,h0)-BN-ELU-fc(h0,h1)-BN-ELU-fc(h1,h2)-BN-ELU-fc(h2, 2*latent)``: the last layer (fc(256,128)
    at the defaults, ``2 * 64 = 128 = h3``) outputs the mean and log-variance of
    :math:`q(z \mid x) = \mathcal N(\mu(x), \mathrm{diag}\,\sigma^2(x))`, :math:`z \in \mathbb R^{64}`; prior
    :math:`p(z) = \mathcal N(0, I)`. Decoder ``fc(latent,h3)-BN-ELU-...-fc(h0,784)`` as in :class:`_Decoder`.

    ``forward``'s ``kl`` is the analytic :math:`\mathrm{KL}(q(z\mid x) \Vert p(z))`, shape ``(B,)``.

    Args:
        latent (int): size of :math:`z` (64).
        hidden (tuple of 4 ints): ``(h0, h1, h2, h3)`` (``(512, 512, 256, 128)``); ``h3`` is the decoder's first
            width.
        observation (str): ``"diagonal"`` (a per-pixel log-variance head, appendix C) or ``"homoscedastic"``
            (one learned variance for all pixels); see :class:`_Decoder`.
    """

    def __init__(self, latent: int = 64, hidden: tuple[int, ...] = HIDDEN, observation: str = "diagonal"):
        super().__init__()
        hidden = _check_hidden(hidden)
        self.latent = int(latent)
        self.encoder = _mlp([PIXELS, *hidden[:3], 2 * self.latent])
        self.decoder = _Decoder(self.latent, hidden, observation)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x (B, 784) -> (mu (B, latent), log_var (B, latent))`` of :math:`q(z \\mid x)`."""
        return _gaussian(self.encoder(x))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, 784) -> (mean (B, 784), log_var (B, 784), kl (B,))`` for one sample :math:`z \\sim q`."""
        mu, lv = self.encode(x)
        z, kl, _ = _Sample.draw(mu, lv, 0.0, 0.0, torch.randn_like(mu))
        mean, log_var = self.decoder(z)
        return mean, log_var, kl

    def importance(self, x: Tensor, num_samples: int, generator: torch.Generator | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """``K`` samples :math:`z_k \\sim q(z \\mid x)` from ``generator`` -> ``(mean (K, B, 784),
        log_var (K, B, 784), log_ratio (K, B))``, ``log_ratio = log p(z_k) - log q(z_k | x)``."""
        mu, lv = self.encode(x)
        eps = _noise((num_samples, *mu.shape), mu, generator)
        z, _, log_ratio = _Sample.draw(mu.expand_as(eps), lv.expand_as(eps), 0.0, 0.0, eps)
        mean, log_var = self.decoder(z)
        return mean, log_var, log_ratio


# ----------------------------------------------------------------------------------------------- Ladder VAE
class LadderVAE(nn.Module):
    r"""Ladder VAE (Sønderby et al., 2016) on the appendix-C trunk.

    Bottom-up (deterministic): ``d_1 = ELU(BN(fc(784,h0)))``, ``d_2 = ELU(BN(fc(h0,h1)))`` (512),
    ``d_3 = ELU(BN(fc(h1,h2)))`` (256), ``d_4 = ELU(BN(fc(h2,h3)))`` (128); linear heads give the bottom-up
    Gaussians :math:`(\hat\mu_l, \hat\sigma_l^2)` of the latent layers :math:`z_1 \in \mathbb R^{64}` (from
    ``d_2``), :math:`z_2 \in \mathbb R^{32}` (from ``d_3``), :math:`z_3 \in \mathbb R^{16}` (from ``d_4``).

    Generative model: :math:`p(z_3) = \mathcal N(0, I)`,
    :math:`p(z_l \mid z_{l+1}) = \mathcal N(\mu_{p,l}, \sigma_{p,l}^2)` with
    ``(mu_p, log_var_p) = fc(d_{l+1}, t)-BN-ELU-fc(t, 2 d_l)`` (``t = top_down`` = 128), and
    :math:`p(x \mid z_1)` by the decoder of :class:`VAE` from :math:`z_1`.

    Inference (top-down, eq. 17-19): :math:`q(z_3 \mid x) = \mathcal N(\hat\mu_3, \hat\sigma_3^2)`;
    :math:`q(z_l \mid z_{l+1}, x) = \mathcal N(\mu_{q,l}, \sigma_{q,l}^2)` with
    :math:`\sigma_{q,l}^{-2} = \hat\sigma_l^{-2} + \sigma_{p,l}^{-2}`,
    :math:`\mu_{q,l} = (\hat\mu_l\hat\sigma_l^{-2} + \mu_{p,l}\sigma_{p,l}^{-2})\sigma_{q,l}^2`, the top-down
    terms evaluated at the sampled :math:`z_{l+1}`.

    ``forward``'s ``kl`` (B,) is :math:`\sum_l \mathrm{KL}(q(z_l \mid z_{l+1}, x) \Vert p(z_l \mid z_{l+1}))`,
    analytic per layer at the sampled parents (an unbiased estimate of :math:`\mathrm{KL}(q(z\mid x)\Vert p(z))`).

    Args:
        latents (tuple of ints): sizes of :math:`z_1, \dots, z_L` bottom to top ((64, 32, 16), 112 in total;
            measured 1.1-1.3x the VAE's time per training step), read off ``d_2, ..., d_{L+1}`` (at most 3).
        hidden (tuple of 4 ints): trunk widths ``(h0, h1, h2, h3)``.
        top_down (int): hidden width of the top-down MLPs.
        observation (str): ``"diagonal"`` (a per-pixel log-variance head, appendix C) or ``"homoscedastic"``
            (one learned variance for all pixels); see :class:`_Decoder`.
    """

    def __init__(self, latents: tuple[int, ...] = (64, 32, 16), hidden: tuple[int, ...] = HIDDEN,
                 top_down: int = 128, observation: str = "diagonal"):
        super().__init__()
        hidden = _check_hidden(hidden)
        self.latents = tuple(int(d) for d in latents)
        if not 1 <= len(self.latents) <= 3:
            raise ValueError(f"latents must have 1 to 3 layers, got {self.latents}.")
        self.trunk = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.BatchNorm1d(b), nn.ELU())
            for a, b in zip((PIXELS, *hidden[:3]), hidden))
        self.heads = nn.ModuleList(nn.Linear(hidden[1 + i], 2 * d) for i, d in enumerate(self.latents))
        self.top_down = nn.ModuleList(_mlp([self.latents[i + 1], top_down, 2 * self.latents[i]])
                                      for i in range(len(self.latents) - 1))
        self.decoder = _Decoder(self.latents[0], hidden, observation)

    def bottom_up(self, x: Tensor) -> list[tuple[Tensor, Tensor]]:
        """``x (B, 784) ->`` the bottom-up ``(mu_hat_l, log_var_hat_l)``, each ``(B, d_l)``, ``l = 1..L``."""
        d, out = x, []
        for i, layer in enumerate(self.trunk):
            d = layer(d)
            if 1 <= i <= len(self.latents):
                out.append(_gaussian(self.heads[i - 1](d)))
        return out

    def _top_down(self, bu: list[tuple[Tensor, Tensor]], eps: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Bottom-up Gaussians and noise of shape ``(*S, d_l)`` -> ``(z_1, kl, log_ratio)``."""
        mu, lv = bu[-1]
        z, kl, log_ratio = _Sample.draw(mu, lv, 0.0, 0.0, eps[-1])
        for i in range(len(self.latents) - 2, -1, -1):
            mu_p, lv_p = _gaussian(_apply(self.top_down[i], z))
            mu_q, lv_q = _merge(*bu[i], mu_p, lv_p)
            z, kl_l, lr_l = _Sample.draw(mu_q, lv_q, mu_p, lv_p, eps[i])
            kl, log_ratio = kl + kl_l, log_ratio + lr_l
        return z, kl, log_ratio

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, 784) -> (mean (B, 784), log_var (B, 784), kl (B,))`` for one sample :math:`z \\sim q`."""
        bu = self.bottom_up(x)
        z, kl, _ = self._top_down(bu, [torch.randn_like(mu) for mu, _ in bu])
        mean, log_var = self.decoder(z)
        return mean, log_var, kl

    def importance(self, x: Tensor, num_samples: int, generator: torch.Generator | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """``K`` samples from ``generator`` -> ``(mean (K, B, 784), log_var (K, B, 784), log_ratio (K, B))``,
        ``log_ratio = sum_l [log p(z_l | z_{l+1}) - log q(z_l | z_{l+1}, x)]``."""
        bu = self.bottom_up(x)
        eps = [_noise((num_samples, *mu.shape), mu, generator) for mu, _ in bu]
        bu = [(mu.expand_as(e), lv.expand_as(e)) for (mu, lv), e in zip(bu, eps)]
        z, _, log_ratio = self._top_down(bu, eps)
        mean, log_var = self.decoder(z)
        return mean, log_var, log_ratio


# ----------------------------------------------------------------------------------------------- Graph VAE
class GraphVAE(nn.Module):
    r"""Graph VAE (He, Gong, Marino, Mori, Lehrmann, ICLR 2019): latent nodes with learned gated DAG dependencies.

    Latent :math:`z = (z_1, \dots, z_N)`, :math:`z_j \in \mathbb R^{d}` (``nodes = 4``, ``node_dim = 16``:
    64 in total, as the VAE). The DAG is over the node order: node :math:`j` may depend on every :math:`i < j`
    through a gate :math:`c_{ij} = \mathrm{sigmoid}(\ell_{ij}) \in (0, 1)` with learned logits
    :math:`\ell_{ij}` (``gate_logits``, one per pair :math:`i < j`, initialised at 0, i.e. :math:`c = 1/2`).

    Prior: :math:`p(z_1) = \mathcal N(0, I)` and, for :math:`j > 1`,
    :math:`p(z_j \mid z_{<j}) = \mathcal N(\mu_j(a_j), \mathrm{diag}\,\sigma_j^2(a_j))`,
    :math:`a_j = \sum_{i<j} c_{ij} f_{ij}(z_i)` with :math:`f_{ij}(z) = \mathrm{ELU}(W_{ij} z + b_{ij})`
    (``message`` = 32 units) and :math:`(\mu_j, \log\sigma_j^2) = \mathrm{fc}(m, m)\text{-ELU-}\mathrm{fc}(m, 2d)`.

    Posterior, with the same top-down structure: the encoder trunk (as :class:`VAE`, last layer
    ``fc(h2, 2 N d)``) gives a bottom-up :math:`(\hat\mu_j, \hat\sigma_j^2)` per node;
    :math:`q(z_1 \mid x) = \mathcal N(\hat\mu_1, \hat\sigma_1^2)` and
    :math:`q(z_j \mid z_{<j}, x)` is the precision-weighted merge of :math:`(\hat\mu_j, \hat\sigma_j^2)` and
    :math:`(\mu_j, \sigma_j^2)(a_j)` (as in :class:`LadderVAE`). Decoder of :class:`VAE` from
    :math:`[z_1, \dots, z_N]` (``N d`` = 64).

    Gates. He et al. treat :math:`c_{ij}` as Bernoulli variables relaxed by a Gumbel-sigmoid (binary Concrete)
    during training. By default (``gate_temperature=None``) this implementation uses the *deterministic* sigmoid
    gate :math:`c_{ij} = \mathrm{sigmoid}(\ell_{ij})` in training and evaluation alike, so the trained and the
    evaluated model are the same density. With ``gate_temperature = tau`` the train-mode forward samples
    :math:`c_{ij} = \mathrm{sigmoid}((\ell_{ij} + \log u - \log(1-u))/\tau)`, :math:`u \sim U(0,1)`, and eval
    mode (``importance``, eval ``forward``) uses the mean gate :math:`\mathrm{sigmoid}(\ell_{ij})`.

    ``forward``'s ``kl`` (B,) is :math:`\sum_j \mathrm{KL}(q(z_j \mid z_{<j}, x) \Vert p(z_j \mid z_{<j}))`,
    analytic per node at the sampled parents.

    Args:
        nodes (int): ``N``.
        node_dim (int): ``d``.
        hidden (tuple of 4 ints): trunk widths ``(h0, h1, h2, h3)``.
        message (int): width ``m`` of the messages :math:`f_{ij}` and of the node conditionals.
        gate_temperature (float, optional): see Gates.
        observation (str): ``"diagonal"`` (a per-pixel log-variance head, appendix C) or ``"homoscedastic"``
            (one learned variance for all pixels); see :class:`_Decoder`.
    """

    def __init__(self, nodes: int = 4, node_dim: int = 16, hidden: tuple[int, ...] = HIDDEN, message: int = 32,
                 gate_temperature: float | None = None, observation: str = "diagonal"):
        super().__init__()
        hidden = _check_hidden(hidden)
        self.nodes, self.node_dim, self.message = int(nodes), int(node_dim), int(message)
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}.")
        self.gate_temperature = gate_temperature
        n, d, m = self.nodes, self.node_dim, self.message
        self.encoder = _mlp([PIXELS, *hidden[:3], 2 * n * d])
        # pairs (i, j), i < j, in the order of the logits vector
        self.pairs = [(i, j) for j in range(n) for i in range(j)]
        self.gate_logits = nn.Parameter(torch.zeros(len(self.pairs)))
        self.register_buffer("_gate_index", torch.tensor([i * n + j for i, j in self.pairs], dtype=torch.long),
                             persistent=False)
        # f_ij for all j > i at once: node i -> (..., (n - 1 - i) * m)
        self.messages = nn.ModuleList(nn.Linear(d, (n - 1 - i) * m) for i in range(n - 1))
        self.conditionals = nn.ModuleList(
            nn.Sequential(nn.Linear(m, m), nn.ELU(), nn.Linear(m, 2 * d)) for _ in range(n - 1))
        self.decoder = _Decoder(n * d, hidden, observation)

    def gates(self) -> Tensor:
        """The gates :math:`c_{ij}` as an ``(N, N)`` matrix (zero on and below the diagonal); sampled (binary
        Concrete) in train mode when ``gate_temperature`` is set, else :math:`\\mathrm{sigmoid}(\\ell_{ij})`."""
        logits = self.gate_logits
        if self.training and self.gate_temperature is not None:
            u = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
            c = torch.sigmoid((logits + torch.log(u) - torch.log1p(-u)) / self.gate_temperature)
        else:
            c = torch.sigmoid(logits)
        out = logits.new_zeros(self.nodes * self.nodes).index_put((self._gate_index,), c)
        return out.view(self.nodes, self.nodes)

    def bottom_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x (B, 784) -> (mu_hat (B, N, d), log_var_hat (B, N, d))``."""
        mu, lv = _gaussian(self.encoder(x))
        return mu.unflatten(-1, (self.nodes, self.node_dim)), lv.unflatten(-1, (self.nodes, self.node_dim))

    def _top_down(self, mu_hat: Tensor, lv_hat: Tensor, eps: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Bottom-up ``(*S, N, d)`` and noise ``(*S, N, d)`` -> ``(z (*S, N d), kl (*S), log_ratio (*S))``."""
        c = self.gates()
        m = self.message
        z, kl, log_ratio = _Sample.draw(mu_hat[..., 0, :], lv_hat[..., 0, :], 0.0, 0.0, eps[..., 0, :])
        zs = [z]
        inbox: list[list[Tensor]] = [[] for _ in range(self.nodes)]  # gated messages to node j
        for j in range(1, self.nodes):
            i = j - 1
            out = F.elu(self.messages[i](zs[i]))
            for k, jj in enumerate(range(i + 1, self.nodes)):
                inbox[jj].append(c[i, jj] * out[..., k * m:(k + 1) * m])
            a = torch.stack(inbox[j]).sum(0)
            mu_p, lv_p = _gaussian(self.conditionals[j - 1](a))
            mu_q, lv_q = _merge(mu_hat[..., j, :], lv_hat[..., j, :], mu_p, lv_p)
            z, kl_j, lr_j = _Sample.draw(mu_q, lv_q, mu_p, lv_p, eps[..., j, :])
            zs.append(z)
            kl, log_ratio = kl + kl_j, log_ratio + lr_j
        return torch.cat(zs, -1), kl, log_ratio

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, 784) -> (mean (B, 784), log_var (B, 784), kl (B,))`` for one sample :math:`z \\sim q`."""
        mu_hat, lv_hat = self.bottom_up(x)
        z, kl, _ = self._top_down(mu_hat, lv_hat, torch.randn_like(mu_hat))
        mean, log_var = self.decoder(z)
        return mean, log_var, kl

    def importance(self, x: Tensor, num_samples: int, generator: torch.Generator | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """``K`` samples from ``generator`` -> ``(mean (K, B, 784), log_var (K, B, 784), log_ratio (K, B))``,
        ``log_ratio = sum_j [log p(z_j | z_{<j}) - log q(z_j | z_{<j}, x)]``."""
        mu_hat, lv_hat = self.bottom_up(x)
        eps = _noise((num_samples, *mu_hat.shape), mu_hat, generator)
        z, _, log_ratio = self._top_down(mu_hat.expand_as(eps), lv_hat.expand_as(eps), eps)
        mean, log_var = self.decoder(z)
        return mean, log_var, log_ratio


MODELS: dict[str, type[nn.Module]] = {"vae": VAE, "ladder": LadderVAE, "graph": GraphVAE}
