"""The result of a truncated sampler: the draws and what produced them."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["TruncatedSamples"]


@dataclass
class TruncatedSamples:
    """Draws of :class:`~hardeq.TruncatedConstrainedNormal` and how they were made.

    Attributes:
        samples (Tensor): ``sample_shape + batch_shape + (n,)``; every entry within its bounds exactly, every row of
            ``A z = k`` within the untruncated per-row tolerance.
        method (str): ``"rejection"`` (exact iid draws of the truncated law), ``"gibbs"`` (random-partition blocked
            Gibbs on the plane, diagonal covariance) or ``"hmc"`` (exact Hamiltonian Monte Carlo on the plane); the
            last two are exact in their stationary law and correlated within a chain.
        acceptance (Tensor | None): ``(*batch)`` measured acceptance of the rejection sampler (accepted / drawn), or
            ``None`` for Gibbs and HMC.
        ess (Tensor | None): ``(*batch, n)`` effective sample size per coordinate (for rejection: the number of
            draws, which are independent), or ``None`` when not measured.
        rhat (Tensor | None): ``(*batch, n)`` split R-hat across the Gibbs or HMC chains; ``None`` for rejection.

    Examples:
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total).truncate(0.0, 2.0)
        >>> out = d.sample_with_info((100,), method="rejection", generator=torch.Generator().manual_seed(0))
        >>> type(out).__name__, out.method, out.samples.shape, out.ess, out.rhat
        ('TruncatedSamples', 'rejection', torch.Size([100, 3]), tensor([100., 100., 100.], dtype=torch.float64), None)
    """

    samples: Tensor
    method: str
    acceptance: Tensor | None = None
    ess: Tensor | None = None
    rhat: Tensor | None = None
