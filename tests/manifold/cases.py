"""Manifolds with known geometry for the tests: circles, spheres, a quadratic energy balance, affine maps."""

import torch

from hardeq import NonlinearConstraint


def sphere(radius_sq, dtype=torch.float64):
    """``|z|^2 = radius_sq`` (a circle for n = 2, a sphere for n = 3); ``radius_sq`` a number or ``(*batch,)``."""
    k = torch.as_tensor(radius_sq, dtype=dtype).reshape(-1, 1) if torch.as_tensor(radius_sq).dim() else \
        torch.tensor([float(radius_sq)], dtype=dtype)
    return NonlinearConstraint(lambda z: (z * z).sum(-1, keepdim=True), k)


def energy_balance(dtype=torch.float64):
    """Two rows on z = (f1, f2, T1, T2, Tmix): mass f1 + f2 - 1 = 0 and energy f1 T1 + f2 T2 - Tmix = 0."""
    def h(z):
        f1, f2, t1, t2, tm = z.unbind(-1)
        return torch.stack([f1 + f2, f1 * t1 + f2 * t2 - tm], -1)
    return NonlinearConstraint(h, torch.tensor([1.0, 0.0], dtype=dtype))


def two_rows(dtype=torch.float64):
    """A sphere and a cubic surface in R^4."""
    def h(z):
        return torch.stack([(z * z).sum(-1), z[..., 0] * z[..., 1] + z[..., 2] ** 3], -1)
    return NonlinearConstraint(h, torch.tensor([2.0, 0.3], dtype=dtype))
