import pytest
import torch

from hardeq import SumConstraint
from hardeq.diffusion import (channel_sum_constraint, channel_sums, clip_to, project_and_clip, project_onto,
                              satisfies_constraint)

from .conftest import assert_exact, gen


def test_channel_sum_constraint_structure():
    c = channel_sum_constraint((2, 3, 4, 5), torch.tensor([1.0, 2.0, 3.0]))
    assert isinstance(c, SumConstraint)
    assert c.num_constraints == 3 and c.event_size == 60 and c.batch_shape == ()
    assert torch.equal(c.index, torch.arange(3).repeat_interleave(20))
    x = torch.randn(2, 3, 4, 5, generator=gen(0))
    torch.testing.assert_close(c.matvec(x.reshape(2, -1)), x.sum((-2, -1)))


def test_channel_sum_constraint_per_image_and_sequence():
    c = channel_sum_constraint((2, 3, 4, 4), torch.zeros(2, 3, dtype=torch.float64))
    assert c.batch_shape == (2,) and c.k.dtype == torch.float64
    c2 = channel_sum_constraint((3, 4, 4), [1.0, 2.0, 3.0])
    assert c2.k.dtype == torch.get_default_dtype() and c2.event_size == 48
    c3 = channel_sum_constraint((3, 4, 4), [1, 2, 3], dtype=torch.float64)
    assert c3.k.dtype == torch.float64


@pytest.mark.parametrize("shape, totals, exc, match", [
    ((2, 3, 4, 4), torch.zeros(2), ValueError, "totals must have shape \\(C,\\) = \\(3,\\)"),
    ((2, 3, 4, 4), torch.zeros(5, 3), ValueError, "need \\(B, C\\) = \\(2, 3\\)"),
    ((2, 3, 4, 4), torch.zeros(2, 3, 1), ValueError, "totals must have shape"),
    ((4, 4), torch.zeros(3), ValueError, "shape must be \\(B, C, H, W\\) or \\(C, H, W\\)"),
    ((2, 0, 4, 4), torch.zeros(0), ValueError, "positive sizes"),
    ("abc", torch.zeros(3), TypeError, "shape must be a tuple of ints"),
    ((2, 3, 4, 4), "abc", TypeError, "totals must be a torch.Tensor"),
])
def test_channel_sum_constraint_errors(shape, totals, exc, match):
    with pytest.raises(exc, match=match):
        channel_sum_constraint(shape, totals)


def test_satisfies_and_channel_sums():
    x = torch.randn(3, 2, 4, 4, generator=gen(0))
    c = channel_sum_constraint(x.shape, channel_sums(x).to(torch.float32))
    assert satisfies_constraint(x, c).all()
    assert not satisfies_constraint(x + 0.01, c).any()
    assert channel_sums(x).dtype == torch.float64


def test_project_and_clip_baselines():
    x = 3 * torch.randn(4, 2, 4, 4, generator=gen(0))
    totals = torch.tensor([6.0, -6.0])
    c = channel_sum_constraint(x.shape, totals)
    p = project_onto(c, x)
    assert_exact(p, totals, 1e-5)
    pc = project_and_clip(c, x)
    assert pc.min() >= -1 and pc.max() <= 1
    assert not satisfies_constraint(pc, c).all()  # clipping breaks the constraint: the point of the baseline
    torch.testing.assert_close(clip_to(x, -0.5, 0.5), x.clamp(-0.5, 0.5))
    with pytest.raises(ValueError, match="lo < hi"):
        clip_to(x, 1.0, -1.0)
