"""Shared image data: the MNIST loader (checksums, user paths) and the brightness water-filling."""

import gzip

import pytest
import torch

from hardeq_studies.images import MNIST_DIR, brightness_mnist, load_mnist, save_grid, water_fill


def test_mnist_shapes_and_label_counts():
    x, y = load_mnist("test")
    assert x.shape == (10_000, 28, 28) and x.dtype == torch.uint8 and y.shape == (10_000,)
    assert torch.bincount(y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    x, y = load_mnist("train")
    assert x.shape == (60_000, 28, 28)
    assert torch.bincount(y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def test_mnist_user_path_raw_files_and_corruption(tmp_path):
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp_path / name).write_bytes(gzip.decompress((MNIST_DIR / f"{name}.gz").read_bytes()))
    x, _ = load_mnist("test", tmp_path)
    assert torch.equal(x, load_mnist("test")[0])
    raw = bytearray((tmp_path / "t10k-labels-idx1-ubyte").read_bytes())
    raw[100] ^= 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "t10k-images-idx3-ubyte").write_bytes((tmp_path / "t10k-images-idx3-ubyte").read_bytes())
    (bad / "t10k-labels-idx1-ubyte").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="MD5"):
        load_mnist("test", bad)
    with pytest.raises(ValueError, match="split"):
        load_mnist("validation")
    with pytest.raises(FileNotFoundError, match="root"):
        load_mnist("test", tmp_path / "missing")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_water_fill_on_mnist_sums_exactly_and_stays_in_range(dtype):
    x, _ = load_mnist("test")
    x = x[:2000].reshape(2000, -1).to(dtype) / 255
    out = water_fill(x, 100.0)
    tol = 5e-5 if dtype == torch.float32 else 1e-10
    assert float((out.double().sum(1) - 100).abs().max()) < tol
    assert float(out.min()) >= 0 and float(out.max()) <= 1
    roomy = (x > 0).sum(1) > 100  # the stroke can hold 100: the background stays black
    assert bool((out[roomy][x[roomy] == 0] == 0).all())


def test_water_fill_scaling_down_is_proportional_and_identity_at_the_target():
    x = torch.tensor([[0.5, 1.0, 0.25, 0.0]], dtype=torch.float64)
    assert torch.allclose(water_fill(x, 1.75), x)
    assert torch.allclose(water_fill(x, 0.875), x / 2)


def test_water_fill_spreads_the_excess_evenly_over_unsaturated_support_pixels():
    x = torch.tensor([[1.0, 0.5, 0.1, 0.0]], dtype=torch.float64)
    out = water_fill(x, 2.4)
    # scaled by 1.5: (1.5, .75, .15, 0); the excess .5 goes evenly (.25 each) to the unsaturated support pixels 1, 2
    assert torch.allclose(out, torch.tensor([[1.0, 1.0, 0.4, 0.0]], dtype=torch.float64))


def test_water_fill_spills_onto_the_background_when_the_support_is_too_small():
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    out = water_fill(x, 2.5)
    assert torch.allclose(out, torch.tensor([[1.0, 0.5, 0.5, 0.5]], dtype=torch.float64))


def test_water_fill_rejects_bad_input():
    with pytest.raises(ValueError, match="pixel sum 0"):
        water_fill(torch.zeros(2, 4), 1.0)
    with pytest.raises(ValueError, match="total"):
        water_fill(torch.ones(2, 4), 5.0)
    with pytest.raises(TypeError, match="floating-point"):
        water_fill(torch.ones(2, 4, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        water_fill(-torch.ones(2, 4), 1.0)


def test_brightness_mnist_and_grid(tmp_path):
    x, y = brightness_mnist("test", 100.0)
    assert x.shape == (10_000, 784) and y.shape == (10_000,)
    assert float((x.double().sum(1) - 100).abs().max()) < 5e-5
    path = save_grid(x[:12].reshape(-1, 28, 28), tmp_path / "grid.png", nrow=6)
    assert path.stat().st_size > 0
