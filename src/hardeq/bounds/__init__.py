r"""Bounds: the Gaussian conditioned on :math:`Az = k` and truncated to a box :math:`l \le z \le u`.

The user-facing object is :class:`hardeq.TruncatedConstrainedNormal`, made by
:meth:`hardeq.ConstrainedNormal.truncate`. This package holds its parts:

* :mod:`~hardeq.bounds.polytope` -- the bounds as tensors and the feasibility checks (empty polytope, no volume);
* :mod:`~hardeq.bounds.mode` -- the mode, an exact QP (breakpoint search, dual semismooth Newton, primal active set);
* :mod:`~hardeq.bounds.rejection` -- exact iid draws by rejection from the untruncated conditional;
* :mod:`~hardeq.bounds.normaliser` -- :math:`\log P(\text{box}\mid\text{plane})`, exact for one free dimension,
  Monte Carlo otherwise, and the gradient identity :math:`\nabla\log Z = \mathbb E_{\text{trunc}}[\nabla\log p]`;
* :mod:`~hardeq.bounds.sum_normaliser` -- the normaliser of one sum row (or a grouped sum) with a diagonal
  covariance: the density of a sum of independent truncated normals, a tilted 1-D FFT convolution with a stated
  grid error;
* :mod:`~hardeq.bounds.hmc` and :mod:`~hardeq.bounds.diagnostics` -- exact Hamiltonian Monte Carlo on the plane and
  its effective sample size and split R-hat (``exact_hmc``, ``HMCResult``; a trajectory's operators and wall times
  in :mod:`~hardeq.bounds.hmc_plane`);
* :mod:`~hardeq.bounds.gibbs` -- random-partition blocked Gibbs (``blocked_gibbs``, ``GibbsResult``), for any
  covariance with a diagonal part through :mod:`~hardeq.bounds.augment` (:math:`\Sigma = D + VV^\top`), its
  partitions (:mod:`~hardeq.bounds.partition`) and exact 1-D truncated normal draws
  (:mod:`~hardeq.bounds.truncnorm`, ``truncated_standard_normal``);
* :mod:`~hardeq.bounds.target` -- what every part sees of the law: ``PlaneTarget`` (``loc``, the covariance, the
  constraint and their conditioner); nothing here imports :mod:`hardeq.distributions`;
* :mod:`~hardeq.bounds.training` -- persistent chains for the normaliser's gradient in training mode
  (``PersistentChains``);
* :mod:`~hardeq.bounds.volume` -- whether a combination of rows leaves the polytope without volume (before any
  normaliser).
"""

from __future__ import annotations

from .diagnostics import effective_sample_size, split_rhat
from .gibbs import GibbsResult, blocked_gibbs, gibbs_unsupported, truncated_standard_normal
from .hmc import ChainStuck, HMCResult, exact_hmc
from .mode import ModeNotFound, truncated_mode
from .normaliser import exact_log_normaliser, log_diff_ndtr, mc_log_normaliser, subset_log_normaliser
from .polytope import check_bounds, check_polytope, row_ranges
from .rejection import AUTO_THRESHOLD, RejectionBudgetExceeded, rejection_sample
from .result import TruncatedSamples
from .target import PlaneTarget
from .training import PersistentChains

__all__ = [
    "AUTO_THRESHOLD",
    "ChainStuck",
    "GibbsResult",
    "HMCResult",
    "ModeNotFound",
    "PersistentChains",
    "PlaneTarget",
    "RejectionBudgetExceeded",
    "TruncatedSamples",
    "blocked_gibbs",
    "check_bounds",
    "check_polytope",
    "effective_sample_size",
    "exact_hmc",
    "exact_log_normaliser",
    "gibbs_unsupported",
    "log_diff_ndtr",
    "mc_log_normaliser",
    "rejection_sample",
    "row_ranges",
    "split_rhat",
    "subset_log_normaliser",
    "truncated_mode",
    "truncated_standard_normal",
]
