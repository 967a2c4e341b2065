r"""Data of the ``diffusion`` study: brightness-constrained MNIST and CIFAR-10, and the constraint they satisfy.

* **MNIST** (:func:`hardeq_studies.images.load_mnist`): ``x / 255`` in ``[0, 1]``, water-filled
  (:func:`~hardeq_studies.images.water_fill`) so that every image's pixel sum is the training set's mean pixel
  sum, then zero-padded from 28x28 to 32x32 (2 pixels on each side; padding adds 0 to the sum).
* **CIFAR-10** from the JPEG (quality 75) copy shipped in ``hardeq_studies/data/cifar10_jpeg`` (lossy: see SOURCE.md
  there), decoded with Pillow (:func:`load_cifar10`; the decoded ``uint8`` array is cached under the study's
  checkpoint folder). Each channel of each image is water-filled to the training set's mean sum of that channel.

**The constraint in the model's space.** The denoiser works in ``[-1, 1]``: ``y = 2 x - 1``. A channel with
``m = H W`` pixels and sum :math:`\sum x = k_c` has :math:`\sum y = 2 k_c - m`, so the samplers are given the
:func:`~hardeq.diffusion.channel_sum_constraint` with totals ``2 k - m`` (:func:`model_totals`). Violations are
measured back in pixel units of ``[0, 1]`` (:func:`residuals`): an image violates the constraint when
``|sum_c x - k_c| > tol`` (``tol = 1e-3``) for any channel ``c``.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["CONFIG_PATH", "CIFAR_DIR", "CIFAR_CLASSES", "DATASETS", "ImageData", "load_config", "decode_cifar10",
           "load_cifar10", "pad_images", "brightness", "load_data", "to_model", "from_model", "model_totals",
           "residuals", "violations", "quantize"]

CONFIG_PATH = Path(__file__).resolve().with_name("config.json")
#: the CIFAR-10 JPEG archives shipped with hardeq (see SOURCE.md there)
CIFAR_DIR = Path(__file__).resolve().parent.parent / "data" / "cifar10_jpeg"
#: CIFAR-10's class folders in the usual label order 0..9
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
DATASETS = ("mnist", "cifar10")
_CIFAR_FILES = {"train": "cifar10_train_jpeg_q75.tar.xz", "test": "cifar10_test_jpeg_q75.tar.xz"}
_CIFAR_SIZES = {"train": 50_000, "test": 10_000}


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """The study's ``config.json`` (or an alternative file)."""
    return json.loads(Path(path or CONFIG_PATH).read_text())


# ------------------------------------------------------------------------------------------------ CIFAR-10
def decode_cifar10(split: str = "train", root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode the JPEG archive of ``split`` with Pillow.

    Returns:
        ``images`` uint8 ``(N, 32, 32, 3)`` (RGB) and ``labels`` int64 ``(N,)``, ordered by class (the usual
        label order, :data:`CIFAR_CLASSES`) and, within a class, by the file's number ``NNNN``.
    """
    from PIL import Image

    if split not in _CIFAR_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    path = Path(root or CIFAR_DIR) / _CIFAR_FILES[split]
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; hardeq ships the CIFAR-10 JPEG archives in {CIFAR_DIR}.")
    items: list[tuple[int, int, np.ndarray]] = []
    with tarfile.open(path, "r:xz") as tar:
        for member in tar:
            if not member.isfile() or not member.name.endswith(".jpg"):
                continue
            parts = member.name.split("/")
            cls, number = parts[-2], int(parts[-1].split(".")[0])
            data = tar.extractfile(member).read()
            with Image.open(io.BytesIO(data)) as im:
                arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
            if arr.shape != (32, 32, 3):
                raise ValueError(f"{path}:{member.name}: expected a 32x32 RGB image, got shape {arr.shape}.")
            items.append((CIFAR_CLASSES.index(cls), number, arr))
    items.sort(key=lambda t: (t[0], t[1]))
    if len(items) != _CIFAR_SIZES[split]:
        raise ValueError(f"{path}: {len(items)} images, expected {_CIFAR_SIZES[split]}.")
    images = np.stack([t[2] for t in items])
    labels = np.array([t[0] for t in items], dtype=np.int64)
    return images, labels


def load_cifar10(split: str = "train", cache_dir: str | Path | None = None,
                 root: str | Path | None = None) -> tuple[Tensor, Tensor]:
    """CIFAR-10 ``split`` as uint8 ``(N, 3, 32, 32)`` and int64 labels; decoded once (:func:`decode_cifar10`) and
    cached as ``cache_dir/cifar10-SPLIT-jpeg-q75.npz`` (atomic write) when ``cache_dir`` is given."""
    cache = Path(cache_dir) / f"cifar10-{split}-jpeg-q75.npz" if cache_dir is not None else None
    if cache is not None and cache.is_file():
        with np.load(cache) as z:
            images, labels = z["images"], z["labels"]
    else:
        images, labels = decode_cifar10(split, root)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    np.savez(fh, images=images, labels=labels)
                os.replace(tmp, cache)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous()
    return x, torch.from_numpy(labels.astype(np.int64))


# ---------------------------------------------------------------------------------------------- transforms
def pad_images(x: Tensor, size: int = 32) -> Tensor:
    """Zero-pad ``(N, C, H, W)`` (or ``(N, H, W)``, given a channel) symmetrically to ``size x size``."""
    if x.dim() == 3:
        x = x[:, None]
    h, w = x.shape[-2:]
    if h > size or w > size or (size - h) % 2 or (size - w) % 2:
        raise ValueError(f"cannot pad {h}x{w} images symmetrically to {size}x{size}.")
    ph, pw = (size - h) // 2, (size - w) // 2
    return torch.nn.functional.pad(x, (pw, pw, ph, ph))


def brightness(x: Tensor, totals: Tensor, *, chunk: int = 2000) -> Tensor:
    """Water-fill every channel of ``x`` ``(N, C, H, W)`` in ``[0, 1]`` to the sum ``totals[c]`` (pixels stay in
    ``[0, 1]``); float32, in chunks (water-filling works in float64)."""
    from ..images import water_fill

    N, C = x.shape[:2]
    flat = x.reshape(N * C, -1)
    t = totals.to(torch.float64).repeat(N)
    out = torch.cat([water_fill(flat[i:i + chunk].to(torch.float64), t[i:i + chunk]).to(torch.float32)
                     for i in range(0, N * C, chunk)])
    return out.reshape(x.shape)


def to_model(x: Tensor) -> Tensor:
    """Pixels in ``[0, 1]`` to the model's ``[-1, 1]``: ``2 x - 1``."""
    return 2 * x - 1


def from_model(y: Tensor) -> Tensor:
    """The model's ``[-1, 1]`` back to ``[0, 1]``: ``(y + 1) / 2`` (no clipping)."""
    return (y + 1) / 2


def model_totals(totals: Tensor, pixels: int) -> Tensor:
    """Channel sums ``k`` of ``x`` in ``[0, 1]`` mapped to the sums of ``y = 2x - 1``: ``2 k - pixels`` (float64)."""
    return 2 * totals.to(torch.float64) - pixels


def residuals(y: Tensor, totals: Tensor) -> Tensor:
    """``|sum_c x - k_c|`` per image and channel, in pixel units of ``[0, 1]`` (``x = (y + 1) / 2``, summed in
    float64, unclipped), shape ``(N, C)``; ``y`` is in the model's ``[-1, 1]``."""
    x = from_model(y.detach().to(torch.float64))
    return (x.sum((-2, -1)) - totals.to(torch.float64)).abs()


def violations(y: Tensor, totals: Tensor, tol: float = 1e-3) -> Tensor:
    """Boolean ``(N,)``: does image ``i`` violate the constraint (any channel off by more than ``tol``)?"""
    return (residuals(y, totals) > tol).any(-1)


def quantize(y: Tensor) -> Tensor:
    """Model output in ``[-1, 1]`` to the 8-bit image a user saves: ``round(255 clip((y + 1) / 2, 0, 1))``, uint8."""
    return (from_model(y.detach().float()).clamp(0, 1) * 255).round().to(torch.uint8)


# ---------------------------------------------------------------------------------------------- data sets
@dataclass
class ImageData:
    """A brightness-constrained image data set in ``[0, 1]``, ``(N, C, 32, 32)`` float32.

    ``totals`` ``(C,)`` float64 are the channel sums ``k_c`` every image satisfies (pixel units of ``[0, 1]``)."""

    name: str
    train: Tensor
    train_labels: Tensor
    test: Tensor
    test_labels: Tensor
    totals: Tensor
    facts: dict[str, Any]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.train.shape[1:])

    @property
    def pixels(self) -> int:
        return int(self.train.shape[-1] * self.train.shape[-2])

    def constraint_totals(self) -> Tensor:
        """The channel totals in the model's ``[-1, 1]`` space (:func:`model_totals`)."""
        return model_totals(self.totals, self.pixels)

    def describe(self) -> dict[str, Any]:
        return {"dataset": self.name, "shape": list(self.shape), "n_train": int(self.train.shape[0]),
                "n_test": int(self.test.shape[0]), "totals": [float(t) for t in self.totals],
                "model_totals": [float(t) for t in self.constraint_totals()], **self.facts}


def _limit(x: Tensor, y: Tensor, n: int | None, seed: int) -> tuple[Tensor, Tensor]:
    """A fixed random subset of ``n`` items (all when ``n`` is None or at least the size)."""
    if n is None or n >= x.shape[0]:
        return x, y
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return x[idx], y[idx]


def load_data(name: str, *, train_limit: int | None = None, test_limit: int | None = None,
              cache_dir: str | Path | None = None, seed: int = 0) -> ImageData:
    """The brightness-constrained data set ``name`` (``"mnist"`` or ``"cifar10"``), 32x32.

    The totals are always the mean channel sums of the *full* training set (the data set's mean brightness);
    ``train_limit`` / ``test_limit`` then keep fixed random subsets (smoke runs)."""
    if name == "mnist":
        from ..images import load_mnist

        xtr, ytr = load_mnist("train")
        xte, yte = load_mnist("test")
        xtr, xte = xtr[:, None], xte[:, None]
        facts = {"source": "MNIST (hardeq_studies/data/mnist), 28x28 zero-padded to 32x32",
                 "constraint": "per-image pixel sum = the training set's mean pixel sum"}
    elif name == "cifar10":
        xtr, ytr = load_cifar10("train", cache_dir)
        xte, yte = load_cifar10("test", cache_dir)
        facts = {"source": "CIFAR-10 JPEG q75 copy (hardeq_studies/data/cifar10_jpeg; lossy, so FID is not comparable "
                           "with published CIFAR-10 numbers)",
                 "constraint": "per-image, per-channel pixel sum = the training set's mean for that channel"}
    else:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}.")
    # the mean channel sums of the full training set (uint8 summed exactly in float64), in [0, 1] units
    totals = xtr.sum((-2, -1), dtype=torch.float64).mean(0) / 255  # (C,)
    xtr, ytr = _limit(xtr, ytr, train_limit, seed)
    xte, yte = _limit(xte, yte, test_limit, seed + 1)
    # water-fill before padding: the zero padding is outside every image's support and adds 0 to the sums
    xtr = pad_images(brightness(xtr.to(torch.float32) / 255, totals))
    xte = pad_images(brightness(xte.to(torch.float32) / 255, totals))
    facts.update({"raw_mean_sum": [float(t) for t in totals], "water_fill": "hardeq_studies.images.water_fill "
                  "(scale, then clip at 1 and spread the excess over the image's own non-zero pixels)"})
    return ImageData(name, xtr, ytr, xte, yte, totals, facts)
