r"""Low-level tensor operations shared by constraints, distributions and estimators, one module per subject:

* :mod:`hardeq.ops.group_sum` -- grouped sums with precise two-level summation (:class:`GroupSum`,
  :func:`group_sum`), the gather back to group members (:func:`gather`), :func:`group_probs`;
* :mod:`hardeq.ops.binomial` -- binomial / multinomial log-pmf and cdf, differentiable in the probability, and
  exact binomial draws (:func:`binomial_sample`), for the Poisson/multinomial family;
* :mod:`hardeq.ops.gram_pairs` -- the row-product matrix of a dense ``A`` (:func:`row_pairs`,
  :func:`gram_from_pairs`): :math:`A\,\mathrm{diag}(v)A^\top` for a batch of ``v`` as one GEMM.

Nothing here knows about distributions or constraints; it sits below both. The names are re-exported here; a
module's constants (``BINOMIAL_CHUNK``, ``PAIR_ELEMS``, ...) are read from that module.
"""

from __future__ import annotations

from .binomial import (
    BINOMIAL_CHUNK,
    CDF_MAX_TERMS,
    MAX_EXACT_COUNT,
    _cdf_with_edges as _cdf_with_edges,  # noqa: F401  (re-exported for hardeq.distributions.poisson_losses)
    binomial_cdf,
    binomial_log_pmf,
    binomial_sample,
    multinomial_log_pmf,
)
from .gram_pairs import PAIR_ELEMS, gram_from_pairs, row_pairs
from .group_sum import SUM_CHUNK, GroupSum, gather, group_probs, group_sum

__all__ = [
    "GroupSum",
    "group_sum",
    "gather",
    "group_probs",
    "binomial_log_pmf",
    "binomial_cdf",
    "binomial_sample",
    "multinomial_log_pmf",
    "row_pairs",
    "gram_from_pairs",
    "BINOMIAL_CHUNK",
    "MAX_EXACT_COUNT",
    "CDF_MAX_TERMS",
    "PAIR_ELEMS",
    "SUM_CHUNK",
]
