"""Exceptions and warnings raised by hardeq."""

from __future__ import annotations

__all__ = ["NotPSDError", "NumericalWarning"]


class NotPSDError(RuntimeError):
    """A matrix that must be symmetric positive definite (usually ``A Sigma A^T``) is not, numerically.

    Examples:
        >>> from hardeq.linalg.cholesky import psd_cholesky
        >>> psd_cholesky(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))  # eigenvalues 3 and -1
        Traceback (most recent call last):
            ...
        hardeq.errors.NotPSDError: A Sigma A^T is not numerically positive definite (batch index (), pivot 2 of 2, ...
        >>> issubclass(NotPSDError, RuntimeError)
        True
    """


class NumericalWarning(RuntimeWarning):
    """A computation lost accuracy (for example it needed jitter, or a residual stayed large).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", NumericalWarning)  # a loss of accuracy raises in this block
        ...     d = ConstrainedNormal(torch.zeros(3), 1.0, constraint=SumConstraint(torch.zeros(3, dtype=torch.long),
        ...                                                                         torch.ones(1)))
        >>> d.mean, issubclass(NumericalWarning, RuntimeWarning)
        (tensor([0.3333, 0.3333, 0.3333]), True)
    """
