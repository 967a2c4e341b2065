"""to_uint8_exact: 8-bit images whose channel sums equal the integer totals exactly (largest remainder)."""

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hardeq.diffusion import box_project, to_uint8_exact



def gen(seed):
    return torch.Generator().manual_seed(seed)


def int_sums(u):
    return u.to(torch.int64).sum((-2, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_integer_sums_and_within_one_level(dtype):
    x = torch.rand(16, 3, 8, 8, generator=gen(0), dtype=torch.float64).to(dtype)
    u = to_uint8_exact(x)
    assert u.dtype == torch.uint8 and u.shape == x.shape
    y = 255 * x.double()
    assert torch.equal(int_sums(u), y.sum((-2, -1)).round().to(torch.int64))
    assert float((u.double() - y).abs().max()) < 1.0  # < 1/255 in [0, 1] units
    plain = y.round().to(torch.uint8)
    assert not torch.equal(int_sums(plain), int_sums(u))  # plain rounding misses some totals here


def test_equals_plain_rounding_where_plain_rounding_hits_the_total():
    x = torch.rand(64, 3, 4, 4, generator=gen(1), dtype=torch.float64)
    u = to_uint8_exact(x)
    y = 255 * x
    plain = y.round().to(torch.uint8)
    hit = int_sums(plain) == y.sum((-2, -1)).round().to(torch.int64)
    assert 0 < int(hit.sum()) < hit.numel()
    assert torch.equal(u[hit], plain[hit])


def test_given_totals_after_box_project_pipeline():
    """Model output in [-1, 1] -> box_project onto [0, 1] totals with 255 k integer -> 8-bit, sums exact."""
    g = gen(2)
    x = 1.5 * torch.randn(8, 3, 16, 16, generator=g)  # far out of range, like a sampler's pre-clamp output
    levels = torch.randint(20 * 256, 200 * 256, (8, 3), generator=g)  # integer grey-level totals
    totals01 = levels.double() / 255
    y = box_project(x / 2 + 0.5, totals01, 1.0, 0.0, 1.0)
    u = to_uint8_exact(y, totals01)
    assert torch.equal(int_sums(u), levels)
    u_own = to_uint8_exact(y)  # the image's own sums round to the same integers
    assert torch.equal(u_own, u)


def test_value_range_minus_one_one():
    x = torch.rand(2, 3, 5, 5, generator=gen(3), dtype=torch.float64) * 2 - 1
    u = to_uint8_exact(x, value_range=(-1.0, 1.0))
    assert torch.equal(int_sums(u), (255 * (x + 1) / 2).sum((-2, -1)).round().to(torch.int64))


def test_ties_limits_and_single_image():
    x = torch.full((1, 1, 2, 3), 0.5, dtype=torch.float64)  # 127.5 each: total 765, raise the first 3
    assert to_uint8_exact(x).flatten().tolist() == [128, 128, 128, 127, 127, 127]
    ones = torch.ones(2, 2, 3, 3)
    assert bool((to_uint8_exact(ones) == 255).all()) and bool((to_uint8_exact(0 * ones) == 0).all())
    x = torch.tensor([1.0, 1.0, 0.999, 0.0]).reshape(1, 2, 2)  # (C, H, W) input
    u = to_uint8_exact(x)
    assert u.shape == (1, 2, 2) and int(u.max()) == 255 and int(u.to(torch.int64).sum()) == round(255 * 2.999)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 30), sparse=st.booleans())
def test_fuzz(seed, m, sparse):
    x = torch.rand(3, 2, 1, m, generator=gen(seed), dtype=torch.float64)
    if sparse:  # many exact 0 and 1 pixels, and exact grey levels
        x = torch.where(x < 0.3, torch.zeros_like(x), torch.where(x > 0.7, torch.ones_like(x), (x * 255).round() / 255))
    u = to_uint8_exact(x)
    y = 255 * x
    assert torch.equal(int_sums(u), y.sum((-2, -1)).round().to(torch.int64))
    assert float((u.double() - y).abs().max()) < 1.0


def test_png_round_trip_keeps_sums():
    x = torch.rand(4, 3, 8, 8, generator=gen(4))
    u = to_uint8_exact(x)
    Image = pytest.importorskip("PIL.Image")
    for img in u:
        buf = io.BytesIO()
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format="PNG")
        back = torch.from_numpy(np.array(Image.open(io.BytesIO(buf.getvalue())))).permute(2, 0, 1)
        assert torch.equal(back, img.cpu())
        assert torch.equal(int_sums(back), int_sums(img.cpu()))


def test_errors():
    x = torch.rand(1, 2, 2, 2, generator=gen(5))
    with pytest.raises(ValueError, match="cannot be reached"):
        to_uint8_exact(x, torch.tensor([4.0, 0.0]))
    with pytest.raises(ValueError, match="value_range"):
        to_uint8_exact(x + 1)
    with pytest.raises(ValueError, match="totals must have shape"):
        to_uint8_exact(x, torch.tensor([1.0, 2.0, 3.0]))


