r"""Image data shared by the image studies (``vae-latent``, ``vae-data``, ``diffusion``).

* :func:`load_mnist` reads the MNIST IDX files shipped in ``hardeq_studies/data/mnist`` (or a user folder), after
  checking the MD5 of their decompressed content against the canonical values. Nothing is downloaded.
* :func:`water_fill` rescales images to a fixed pixel sum within ``[0, upper]`` (the paper's "brightness"
  constraint), exactly and vectorised over the batch.
* :func:`save_grid` writes a PNG grid of images (sample grids, reconstructions, before/after pairs).
"""

from __future__ import annotations

import gzip
import hashlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .figures import PNG_METADATA

__all__ = ["MNIST_DIR", "load_mnist", "water_fill", "brightness_mnist", "save_grid"]

#: the MNIST files shipped with hardeq (see SOURCE.md there: provenance, licence, checksums)
MNIST_DIR = Path(__file__).resolve().parent / "data" / "mnist"

#: MD5 of the *decompressed* IDX files (the canonical MNIST values), so LeCun's .gz, ours, or raw files all pass
_MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
_SPLIT_PREFIX = {"train": "train", "test": "t10k"}


def _read_idx(root: Path, stem: str, verify: bool) -> bytes:
    for name in (stem + ".gz", stem):
        path = root / name
        if path.is_file():
            raw = path.read_bytes()
            data = gzip.decompress(raw) if name.endswith(".gz") else raw
            if verify and hashlib.md5(data).hexdigest() != _MNIST_MD5[stem]:
                raise ValueError(f"{path}: the decompressed content does not have the canonical MNIST MD5 "
                                 f"{_MNIST_MD5[stem]} (got {hashlib.md5(data).hexdigest()}); the file is "
                                 "corrupt or not MNIST (pass verify=False to read it anyway).")
            return data
    raise FileNotFoundError(f"root: no {stem}.gz or {stem} in {root}; hardeq ships MNIST in {MNIST_DIR}.")


@lru_cache(maxsize=4)
def _load_mnist_cached(split: str, root: str, verify: bool) -> tuple[Tensor, Tensor]:
    prefix = _SPLIT_PREFIX[split]
    images = _read_idx(Path(root), f"{prefix}-images-idx3-ubyte", verify)
    labels = _read_idx(Path(root), f"{prefix}-labels-idx1-ubyte", verify)
    n = int.from_bytes(images[4:8], "big")
    x = torch.from_numpy(np.frombuffer(images, np.uint8, offset=16).reshape(n, 28, 28).copy())
    y = torch.from_numpy(np.frombuffer(labels, np.uint8, offset=8).astype(np.int64))
    if y.shape[0] != n:
        raise ValueError(f"MNIST {split}: {n} images but {y.shape[0]} labels.")
    return x, y


def load_mnist(split: str = "train", root: str | Path | None = None, *, verify: bool = True) -> tuple[Tensor, Tensor]:
    """MNIST images and labels.

    Args:
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000).
        root: folder holding ``{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (``.gz`` or raw); default the
            copy shipped with hardeq.
        verify: check the MD5 of the decompressed files against the canonical MNIST values.

    Returns:
        ``images`` uint8 ``(N, 28, 28)`` (0 = background) and ``labels`` int64 ``(N,)``.
    """
    if split not in _SPLIT_PREFIX:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    root = Path(root) if root is not None else MNIST_DIR
    if not root.is_dir():
        raise FileNotFoundError(f"root: {root} is not a folder.")
    x, y = _load_mnist_cached(split, str(root.resolve()), bool(verify))
    return x.clone(), y.clone()


def water_fill(images: Tensor, total: float | Tensor, *, upper: float = 1.0) -> Tensor:
    r"""Rescale each image to pixel sum ``total`` with every pixel in ``[0, upper]``.

    The image is first scaled, :math:`x \leftarrow x \cdot t / \sum x`. Scaling down keeps every pixel in
    range. Scaling up can push stroke pixels above ``upper``; then, repeatedly, the pixels above ``upper`` are
    clipped to it and their excess is spread *evenly* over the pixels that can still take some -- the
    unsaturated pixels of the image's own support (pixels that were non-zero in the input) -- until no pixel
    exceeds ``upper``. Each round saturates at least one more pixel, so it ends after at most ``numel`` rounds
    (a handful in practice). Only when the support cannot hold ``total`` (fewer than ``total / upper`` support
    pixels) does the excess spill, evenly, onto the zero pixels as well.

    Why the support: the paper "distributes the extra pixel values to white pixels". For MNIST (0 = black
    background) those are the stroke. Spreading over the whole image would lay a grey haze over the ~650
    background pixels, changing every image's support; spreading over the support brightens the stroke's
    anti-aliased edge, which is what a brighter digit looks like.

    Computed in float64; the result has ``images``' dtype, sums to ``total`` to that dtype's round-off and
    lies in ``[0, upper]``.

    Args:
        images: ``(N, *shape)`` non-negative floats, each with a positive sum.
        total: the target sum, a float or a tensor broadcastable to ``(N,)``.
        upper: the largest pixel value.

    Returns:
        ``(N, *shape)``.
    """
    if not isinstance(images, Tensor) or not images.is_floating_point():
        raise TypeError(f"images must be a floating-point tensor, got {type(images).__name__}"
                        f"{'' if not isinstance(images, Tensor) else ' of dtype ' + str(images.dtype)}.")
    if images.dim() < 2:
        raise ValueError(f"images must have shape (N, *pixels), got {tuple(images.shape)}.")
    x = images.detach().reshape(images.shape[0], -1).to(torch.float64)
    if bool((x < 0).any()):
        raise ValueError("images must be non-negative.")
    t = torch.as_tensor(total, dtype=torch.float64, device=x.device).expand(x.shape[0]).clone()
    if not bool((t > 0).all()) or bool((t > upper * x.shape[1]).any()):
        raise ValueError(f"total must lie in (0, upper * pixels] = (0, {upper * x.shape[1]}], got {total}.")
    sums = x.sum(1)
    if bool((sums <= 0).any()):
        raise ValueError(f"images: {int((sums <= 0).sum())} image(s) have pixel sum 0 and cannot be rescaled.")
    support = x > 0
    x = x * (t / sums)[:, None]
    for _ in range(x.shape[1] + 1):
        over = (x - upper).clamp_min(0.0)
        excess = over.sum(1)
        if not bool((excess > 1e-12 * t).any()):
            break
        x = x.clamp_max(upper)
        open_pixels = x < upper
        eligible = open_pixels & support
        room = torch.where(eligible, upper - x, torch.zeros_like(x)).sum(1)
        eligible = torch.where((room < excess)[:, None], open_pixels, eligible)
        count = eligible.sum(1).clamp_min(1)
        x = x + eligible * (excess / count)[:, None]
    x = x.clamp(0.0, upper)
    # round-off: the last rounds leave |sum - total| ~ 1e-13; put it on the non-zero unsaturated pixels
    room = (x < upper) & (x > 0)
    room = torch.where(room.any(1, keepdim=True), room, x < upper)
    x = x + room * ((t - x.sum(1)) / room.sum(1).clamp_min(1))[:, None]
    return x.clamp(0.0, upper).to(images.dtype).reshape(images.shape)


def brightness_mnist(split: str = "train", total: float = 100.0, root: str | Path | None = None, *,
                     limit: int | None = None, chunk: int = 10_000) -> tuple[Tensor, Tensor]:
    """MNIST in ``[0, 1]`` (``x / 255``), each image water-filled to pixel sum ``total``: ``(N, 784)`` float32
    and the labels ``(N,)``; ``limit``: only the first ``limit`` images."""
    images, labels = load_mnist(split, root)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    x = images.reshape(images.shape[0], -1).to(torch.float32) / 255.0
    out = torch.cat([water_fill(c, total) for c in x.split(chunk)])
    return out, labels


def save_grid(images: Tensor, path: str | Path, *, nrow: int = 10, pad: int = 2, scale: int = 1) -> Path:
    """Write a PNG grid of grey (``(N, H, W)`` / ``(N, 1, H, W)``) or RGB (``(N, 3, H, W)``) images in ``[0, 1]``,
    ``nrow`` images per row, separated by ``pad`` white pixels; returns the path."""
    import matplotlib.image

    x = images.detach().to(torch.float32).cpu().clamp(0, 1)
    if x.dim() == 3:
        x = x[:, None]
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"images must have shape (N, H, W) or (N, 1|3, H, W), got {tuple(images.shape)}.")
    n, c, h, w = x.shape
    rows = -(-n // nrow)
    grid = torch.ones(c, rows * (h + pad) + pad, nrow * (w + pad) + pad)
    for i in range(n):
        r, q = divmod(i, nrow)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = x[i]
    if scale > 1:
        grid = grid.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
    arr = grid.permute(1, 2, 0).numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if c == 1:
        matplotlib.image.imsave(path, arr[..., 0], cmap="gray", vmin=0.0, vmax=1.0, metadata=PNG_METADATA)
    else:
        matplotlib.image.imsave(path, arr, metadata=PNG_METADATA)
    return path
