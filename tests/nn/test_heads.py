import pytest
import torch

import hardeq
from hardeq.nn import ConstrainedGaussianHead


def test_head_outputs_satisfy_per_sample_constraints_and_train():
    torch.manual_seed(0)
    A = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, -1.0, 1.0]])
    head = ConstrainedGaussianHead(3, 4, constraint_matrix=A)
    x = torch.randn(256, 3)
    y_true = torch.cat([x, x[:, :1] ** 2], -1)
    k = y_true @ A.T
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    losses = []
    for _ in range(100):
        dist = head(x, k)
        loss = dist.expected_l2(y_true).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    dist = head(x, k)
    assert bool(dist.constraint.check(dist.mean).all())
    assert bool(dist.constraint.check(dist.rsample((3,))).all())
    assert "a=2" in repr(head)


def test_head_with_group_sums():
    head = ConstrainedGaussianHead(5, 6, index=torch.tensor([0, 0, 1, 1, 1, 2]))
    dist = head(torch.randn(4, 5), torch.ones(4, 3))
    assert dist.batch_shape == (4,) and dist.event_shape == (6,)
    torch.testing.assert_close(dist.constraint.matvec(dist.sample()), torch.ones(4, 3))
    assert torch.all(dist.variance[:, 5] == 0)  # a group of one is pinned


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"constraint_matrix": torch.ones(1, 3)}, "4 columns"),
    ({"constraint_matrix": torch.ones(2, 4)}, "full row rank"),
    ({"index": torch.tensor([0, 1, 1])}, r"shape \(4,\)"),
    ({"constraint_matrix": torch.ones(1, 4), "min_scale": 0.0}, "min_scale"),
])
def test_head_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ConstrainedGaussianHead(2, 4, **kwargs)


def test_head_bad_call():
    head = ConstrainedGaussianHead(2, 4, constraint_matrix=torch.ones(1, 4))
    with pytest.raises(ValueError, match="features"):
        head(torch.randn(3, 5), torch.ones(3, 1))
    with pytest.raises(ValueError, match="constraint_value"):
        head(torch.randn(3, 2), torch.ones(3, 2))
    assert isinstance(head(torch.randn(3, 2), torch.ones(3, 1)), hardeq.ConstrainedNormal)
