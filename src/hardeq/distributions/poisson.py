r"""Independent Poissons conditioned on their (grouped) sums: products of multinomials."""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple, Self

import torch
from torch import Tensor
from torch.distributions import Binomial, Distribution, constraints

from .._utils import assert_deferred, check_finite, check_group_index, is_tracing, validate_default
from .._validation import not_a_tensor
from ..constraints import EqualityConstraint, SumConstraint
from ..constraints._cache import PerTensorCache, lookup_on_host, no_host_reads
from ..estimators import poisson as _poisson_estimators  # noqa: F401  (registers the estimators)
from ..ops import BINOMIAL_CHUNK, MAX_EXACT_COUNT, binomial_sample, gather, group_probs, group_sum, multinomial_log_pmf
from ..estimators.registry import get_estimator
from .poisson_losses import binomial_expected_l1, binomial_expected_l2
from ..ops.binomial import _bd0, _stirlerr, binomial_log_pmf  # entropy: Loader's terms, no lgamma(k + 1) to cancel

__all__ = ["ENTROPY_MAX_TERMS", "ConstrainedPoisson", "grouped_multinomial"]

_size = torch.Size | list[int] | tuple[int, ...]

#: Largest number of binomial pmf terms :meth:`ConstrainedPoisson.entropy` sums in one call (over all
#: coordinates and batch elements); beyond, ``ValueError``.
ENTROPY_MAX_TERMS = 2**22

#: pmf terms evaluated at once by the entropy's sum (memory bound)
_ENTROPY_CHUNK = 2**20


class _GroupedMultinomial(constraints.Constraint):
    r"""Non-negative integer vectors whose group sums equal the totals: :math:`\{z \in \mathbb N^n :
    \sum_{i : g(i) = j} z_i = k_j\ \forall j\}`. ``check`` returns one boolean per event (``event_dim = 1``).
    """

    is_discrete = True
    event_dim = 1

    def __init__(self, total: Tensor, index: Tensor | None) -> None:
        self.total = total  # shape: (*batch, a)
        self.index = index
        super().__init__()

    def check(self, value: Tensor) -> Tensor:
        if not value.is_floating_point():
            value = value.to(self.total.dtype)
        ok = ((value >= 0) & (value == torch.floor(value))).all(-1)
        sums = group_sum(value, self.index, self.total.shape[-1])
        return ok & (sums == self.total).all(-1)


grouped_multinomial = _GroupedMultinomial


class ConstrainedPoisson(Distribution):
    r"""Independent Poissons :math:`z_i \sim \mathrm{Poisson}(\theta_i)` conditioned on group sums
    :math:`\sum_{i : g(i) = j} z_i = k_j`:

    .. math::
        z_{G_j} \mid k \sim \mathrm{Multinomial}\big(k_j,\; p_{G_j}\big), \qquad
        p_i = \theta_i \Big/ \sum_{l : g(l) = g(i)} \theta_l ,

    independently over the groups :math:`G_j = \{i : g(i) = j\}`; without ``index`` there is one group and
    one total. The conditional marginal of a coordinate is :math:`\mathrm{Binomial}(k_{g(i)}, p_i)`, so

    .. math::
        \mathbb E z_i = k p_i, \quad \mathrm{Var}\, z_i = k p_i (1 - p_i), \quad
        \mathbb E (z_i - y_i)^2 = k p_i (1 - p_i) + (k p_i - y_i)^2 ,

    and :math:`\mathbb E|z_i - y_i|` has the closed form of
    :func:`~hardeq.distributions.poisson_losses.binomial_expected_l1`. :meth:`log_prob` is the pmf (w.r.t.
    counting measure on :math:`\mathbb N^n`): the product of the groups' multinomial pmfs. Off the support
    (group sums other than the totals, negative or non-integer counts) it raises with validation on, as
    :meth:`ConstrainedNormal.log_prob <hardeq.ConstrainedNormal.log_prob>` off the plane, and is
    :math:`-\infty` with ``validate_args=False``.

    Sampling is exact, by conditional binomials down a binary tree of each group's members, in O(n) time and
    memory per sample **whatever the totals** (see :meth:`sample`). Dtype rule: counts are exact integers up to
    :math:`2^{53}` in float64 and :math:`2^{24}` in float32, so with a float32 (or half) ``rate`` a larger total
    is a ``ValueError`` at construction (pass float64). :meth:`rsample` returns the same exact sample with the
    gradient w.r.t. ``rate`` of the
    chosen estimator (``hardeq.estimators.poisson``): ``"marginal_expectation"`` (default),
    ``"constrained_marginal"``, ``"unconstrained_marginal"`` or ``"random"``; none is unbiased.

    Args:
        rate (Tensor): :math:`\theta > 0`, floating point, shape ``(*batch, n)``.
        total (Tensor or int): :math:`k`, non-negative integer valued (float or integer tensor; converted to
            ``rate``'s dtype), shape ``(*batch,)`` without ``index`` and ``(*batch, a)`` with it; its batch
            dims broadcast with ``rate``'s.
        index (LongTensor, optional): group id of every coordinate, shape ``(n,)``, values in ``[0, a)``,
            every group non-empty (PyG's ``batch`` vector).
        constraint (EqualityConstraint, optional): the primary form, instead of ``total`` and ``index``: a
            grouped-sum constraint such as :class:`~hardeq.SumConstraint`, whose ``group_index`` gives the groups
            and ``k`` the totals. Any other constraint is a ``TypeError``.
        validate_args (bool, optional): value checks (``rate`` positive and finite, ``total`` a non-negative
            integer, ``log_prob`` arguments in the support), as in ``torch.distributions``; defaults to
            torch's global setting. Types, shapes, ``index`` and the dtype rule are always checked, and
            :meth:`sample` always refuses totals and rates it cannot honour (a total of 3.5 never yields
            vectors summing to 4). With ``validate_args=False`` the closed forms (:meth:`log_prob`,
            :attr:`mean`, ...) trust ``rate``, as in ``torch.distributions``: a non-positive rate gives
            undefined values there (NaN included); keep validation on while rates are not known positive.

    Shapes:
        batch_shape: ``broadcast(rate.shape[:-1], total batch dims)``; event_shape: ``(n,)``.

    Example:
        >>> d = ConstrainedPoisson(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 5.0]),
        ...                        index=torch.tensor([0, 0, 1, 1]))
        >>> z = d.sample((6,))
        >>> z.shape, bool((z[:, :2].sum(-1) == 3).all() and (z[:, 2:].sum(-1) == 5).all())
        (torch.Size([6, 4]), True)
    """

    arg_constraints = {  # noqa: RUF012  (torch's convention: a class-level dict)
        "rate": constraints.independent(constraints.positive, 1),
        "total": constraints.nonnegative_integer,
    }
    has_rsample = True

    def __init__(
        self,
        rate: Tensor,
        total: Tensor | int | None = None,
        *,
        index: Tensor | None = None,
        constraint: EqualityConstraint | None = None,
        validate_args: bool | None = None,
    ) -> None:
        if constraint is not None:
            if total is not None or index is not None:
                raise ValueError("pass constraint= alone, or the shortcut (total, index=), not both.")
            index = constraint.group_index if isinstance(constraint, EqualityConstraint) else None
            if index is None:
                raise TypeError("constraint must be a grouped-sum constraint such as hardeq.SumConstraint (Poissons "
                                "are conditioned on group sums; its group_index is the group of each coordinate), "
                                f"got {constraint!r}.")
            total = constraint.k
        elif total is None:
            raise ValueError("total (with optional index=) or constraint= must be given.")
        if not isinstance(rate, Tensor):
            raise not_a_tensor("rate", rate)
        if not rate.is_floating_point():
            raise TypeError(
                f"rate must be a floating-point tensor (float32 or float64), got dtype {rate.dtype}."
            )
        if rate.dim() < 1 or rate.shape[-1] == 0:
            raise ValueError(f"rate must have shape (*batch, n) with n >= 1, got {tuple(rate.shape)}.")
        n = rate.shape[-1]

        if index is not None:
            if not isinstance(index, Tensor):
                raise TypeError(
                    f"index must be a torch.Tensor of dtype torch.long, got {type(index).__name__}."
                )
            if index.dtype != torch.long:
                raise TypeError(f"index must have dtype torch.long, got {index.dtype}.")
            if index.shape != (n,):
                raise ValueError(
                    f"index must have shape (n,) = ({n},) with n = rate.shape[-1], got {tuple(index.shape)}."
                )
            if index.device != rate.device:
                raise ValueError(f"index is on device {index.device} but rate is on {rate.device}.")

        if isinstance(total, numbers.Number) and not isinstance(total, bool):
            if index is not None:
                raise ValueError(
                    "with index, total must be a tensor of shape (*batch, a), got a Python number."
                )
            total = torch.tensor(total, dtype=rate.dtype, device=rate.device)
        if not isinstance(total, Tensor):
            raise TypeError(
                f"total must be a torch.Tensor (float or integer dtype), got {type(total).__name__}."
            )
        if total.dtype == torch.bool or total.is_complex():
            raise TypeError(f"total must have a floating-point or integer dtype, got {total.dtype}.")
        if total.device != rate.device:
            raise ValueError(f"total is on device {total.device} but rate is on {rate.device}.")
        exact = round(2 / torch.finfo(rate.dtype).eps)  # 2**24 in float32, 2**53 in float64, 2**11 in float16
        if rate.dtype != torch.float64 and total.numel():
            too_large = ((total > exact) & torch.isfinite(total)).any()
            message = (f"total must be at most 2**{exact.bit_length() - 1} = {exact} when rate has dtype {rate.dtype} "
                       f"(larger counts are not exact integers in that dtype, so samples could not sum to the total)")
            hint = ". Pass rate (and total) as torch.float64, which holds counts exactly up to 2**53."
            # (on a device where a read-back synchronises: asserted there, deferred; a CPU raises it at once)
            given = total
            assert_deferred(~too_large, message + hint,
                            lambda: ValueError(f"{message}, got {given.max().item():.6g}{hint}"))
        total = total.to(rate.dtype)

        if index is None:
            num_groups = 1
            total_batch = total.shape
            group_total = total.unsqueeze(-1)
        else:
            if total.dim() < 1:
                raise ValueError(
                    f"with index, total must have shape (*batch, a) (one total per group), got "
                    f"{tuple(total.shape)}."
                )
            num_groups = total.shape[-1]
            total_batch = total.shape[:-1]
            group_total = total
        try:
            batch_shape = torch.broadcast_shapes(rate.shape[:-1], total_batch)
        except RuntimeError:
            raise ValueError(
                f"batch shapes do not broadcast: rate.shape = {tuple(rate.shape)} (batch "
                f"{tuple(rate.shape[:-1])}), total.shape = {tuple(total.shape)} (batch {tuple(total_batch)})."
            ) from None

        self.index = index
        self.num_groups = num_groups
        self._unbroadcasted_rate = rate
        self.rate = rate.expand(batch_shape + (n,))
        self.total = total.expand(batch_shape + total.shape[len(total_batch) :])
        self._group_total = group_total.expand(batch_shape + (num_groups,))  # shape: (*batch, a)
        self._layout = _split_tree_of(index, n, num_groups, rate.device, validate_default(validate_args))
        super().__init__(batch_shape, torch.Size([n]), validate_args=validate_args)
        if self._validate_args:
            check_finite("rate", rate)

    # ------------------------------------------------------------------------------------------ shapes
    def expand(self, batch_shape: _size, _instance: Self | None = None) -> Self:
        new: Self = self._get_checked_instance(  # type: ignore[no-untyped-call]  # torch: unannotated helper
            ConstrainedPoisson, _instance)
        batch_shape = torch.Size(batch_shape)
        n = self.event_shape[0]
        new.index = self.index
        new.num_groups = self.num_groups
        new._unbroadcasted_rate = self._unbroadcasted_rate
        new.rate = self.rate.expand(batch_shape + (n,))
        new.total = self.total.expand(batch_shape + self.total.shape[len(self.batch_shape) :])
        new._group_total = self._group_total.expand(batch_shape + (self.num_groups,))
        new._layout = self._layout
        super(ConstrainedPoisson, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def constraint(self) -> SumConstraint:
        """The group-sum constraint as a :class:`~hardeq.SumConstraint` (one group when ``index`` is None)."""
        n = self.event_shape[0]
        index = self.index if self.index is not None else torch.zeros(n, dtype=torch.long, device=self.rate.device)
        return SumConstraint(index, self._group_total, validate_args=False)

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _GroupedMultinomial(self._group_total, self.index)

    # ------------------------------------------------------------------------------------------ moments
    @property
    def probs(self) -> Tensor:
        r""":math:`p_i = \theta_i / \sum_{l : g(l) = g(i)} \theta_l`, shape ``(*batch, n)``. O(n); recomputed
        on each access so that every call builds a fresh autograd graph."""
        p = group_probs(self._unbroadcasted_rate, self.index, self.num_groups)
        return p.expand(self.batch_shape + self.event_shape)

    @property
    def _coordinate_total(self) -> Tensor:
        """:math:`k_{g(i)}`, shape ``(*batch, n)``."""
        return gather(self._group_total, self.index).expand(self.batch_shape + self.event_shape)

    @property
    def mean(self) -> Tensor:
        r""":math:`\mathbb E z_i = k_{g(i)}\, p_i`, shape ``(*batch, n)``."""
        return self._coordinate_total * self.probs

    @property
    def variance(self) -> Tensor:
        r""":math:`\mathrm{Var}\, z_i = k_{g(i)}\, p_i (1 - p_i)`, shape ``(*batch, n)``."""
        p = self.probs
        return self._coordinate_total * p * (1 - p)

    def marginal(self) -> Binomial:
        r"""The conditional marginals :math:`z_i \sim \mathrm{Binomial}(k_{g(i)}, p_i)` as one
        ``torch.distributions.Binomial`` of batch shape ``(*batch, n)`` (the coordinates are dependent).

        Its ``log_prob`` is torch's ``lgamma`` form in ``rate``'s dtype: at large totals it loses about
        :math:`k \log k\,\varepsilon` (4e-3 at :math:`k = 10^{12}` in float64; useless above :math:`10^5` in
        float32). :func:`hardeq.ops.binomial_log_pmf` evaluates the same pmf in float64 to about
        :math:`10^{-13}`."""
        return Binomial(
            total_count=self._coordinate_total, probs=self.probs, validate_args=self._validate_args
        )

    # ------------------------------------------------------------------------------------------ losses
    def _check_target(self, y: Tensor | float) -> Tensor:
        if isinstance(y, numbers.Number) and not isinstance(y, bool):
            y = torch.tensor(y, dtype=self.rate.dtype, device=self.rate.device)
        if not isinstance(y, Tensor):
            raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}.")
        shape = self.batch_shape + self.event_shape
        try:
            torch.broadcast_shapes(y.shape, shape)
        except RuntimeError:
            raise ValueError(
                f"y must broadcast with batch_shape + event_shape = {tuple(shape)}, got {tuple(y.shape)}."
            ) from None
        if y.dim() >= 1 and y.shape[-1] not in (1, shape[-1]):
            raise ValueError(f"y must have last dimension n = {shape[-1]} (or 1), got {tuple(y.shape)}.")
        if self._validate_args:
            check_finite("y", y)
        return y.to(self.rate.dtype) if not y.is_floating_point() else y

    def expected_l2(self, y: Tensor) -> Tensor:
        r"""Per coordinate :math:`\mathbb E (z_i - y_i)^2 = k p_i (1 - p_i) + (k p_i - y_i)^2` (exact).

        Args:
            y (Tensor): target, broadcastable with ``(*batch, n)`` (typically integer counts with the
                same group sums; any real values work).

        Returns:
            Tensor: ``broadcast(y.shape, (*batch, n))``, differentiable in ``rate`` (and ``y``). Cost: O(n).
        """
        y = self._check_target(y)
        return binomial_expected_l2(y, self._coordinate_total, self.probs)

    def expected_l1(self, y: Tensor) -> Tensor:
        r"""Per coordinate :math:`\mathbb E|z_i - y_i|`, exact, from the binomial marginal
        :math:`\mathrm{Bin}(k, p_i)` (:math:`k = k_{g(i)}`):

        .. math::
            \mathbb E |z_i - y_i| = (k p_i - y_i)\big(1 - 2F(j; k, p_i)\big) + 2 (k - j)\, p_i\, b(j; k, p_i),
            \qquad j = \lfloor y_i \rfloor,

        with :math:`b` and :math:`F` the binomial pmf and cdf (derivation in
        :mod:`hardeq.distributions.poisson_losses`).

        Args:
            y (Tensor): target, broadcastable with ``(*batch, n)``; integers in ``0..k`` are the intended
                use, any real value is handled exactly.

        Returns:
            Tensor: ``broadcast(y.shape, (*batch, n))``, differentiable in ``rate`` (via
            :math:`\partial_p F(m; k, p) = -k\, b(m; k - 1, p)`).

        Cost: O(N W) time for N = the output's size, :math:`W \le \min(y + 1, 48\sqrt{k p_i (1 - p_i)} + 800)`
        (a float64 sum of the pmf values in a window around the mean, :func:`hardeq.ops.binomial_cdf`; memory
        bounded by chunks of 2^20 terms): any total whose variance is moderate (:math:`k = 10^{12}` with
        :math:`p_i = 10^{-6}`: W = 5e4).

        Raises:
            ValueError: when ``N W`` exceeds ``hardeq.ops.CDF_MAX_TERMS`` (:math:`2^{22}`), naming the total and
                the bound: e.g. 100 coordinates of equal rate at :math:`k = 10^{12}` (W = 4e6 each). Use
                :meth:`expected_l2` there.
        """
        y = self._check_target(y)
        return binomial_expected_l1(y, self._coordinate_total, self.probs)

    # ------------------------------------------------------------------------------------------ density
    def _validate_sample(self, value: Tensor) -> None:
        # Shapes, values that are non-negative integers, and group sums equal to the totals (the support),
        # as ConstrainedNormal.log_prob rejects points off the plane.
        if not isinstance(value, Tensor):
            raise not_a_tensor("value", value)
        n = self.event_shape[0]
        expected = self.batch_shape + self.event_shape
        if value.dim() < 1 or value.shape[-1] != n:
            raise ValueError(
                f"value must have shape (*sample_shape, *batch_shape, n) with n = {n}, got "
                f"{tuple(value.shape)}."
            )
        for actual, want in zip(reversed(value.shape), reversed(expected), strict=False):
            if actual != 1 and want != 1 and actual != want:
                raise ValueError(
                    f"value (shape {tuple(value.shape)}) does not broadcast with batch_shape + event_shape = "
                    f"{tuple(expected)}."
                )
        v = value if value.is_floating_point() else value.to(torch.float64)
        if not bool(((v >= 0) & (v == torch.floor(v))).all()):
            raise ValueError(
                f"Expected value (Tensor of shape {tuple(value.shape)}) to hold non-negative integer counts, "
                f"but found invalid values:\n{value}"
            )
        sums = group_sum(v.to(torch.float64), self.index, self.num_groups)
        total = self._group_total.detach().to(torch.float64)
        sums, total = torch.broadcast_tensors(sums, total)
        off = sums != total
        if bool(off.any()):
            where = tuple(int(i) for i in off.nonzero()[0])[:-1]
            at = f" at event {where}" if where else ""
            what = "sum equals" if self.index is None else "group sums (over index) equal"
            raise ValueError(
                f"Expected value to lie in the support, non-negative integer counts whose {what} total, "
                f"but{at} its sums are {sums[where].tolist()} while total is {total[where].tolist()} "
                f"({int(off.any(-1).sum())} of {off.any(-1).numel()} events off the "
                "support). Pass validate_args=False to get log_prob = -inf there instead."
            )

    def log_prob(self, value: Tensor) -> Tensor:
        r"""Multinomial log-pmf, summed over the groups:

        .. math::
            \log p(z) = \sum_j \Big[\log k_j! - \sum_{i \in G_j} \log z_i!\Big] + \sum_i z_i \log p_i

        for non-negative integer ``z`` with the right group sums, evaluated in float64 (whatever ``rate``'s
        dtype) in Loader's saddle-point form (:func:`hardeq.ops.multinomial_log_pmf`), where the ``lgamma`` form
        above loses :math:`10^{-2}` at totals of :math:`10^{12}`. Accuracy, measured against 60-digit references
        (mpmath, from the same float64 rates): an absolute error within
        :math:`10^{-13} + \varepsilon_{64}\sum_i |z_i - k p_i|`, the float64 rounding of the means :math:`k p_i`
        times the slope :math:`1 - z_i / (k p_i)` of the deviance. At :math:`k = 10^{12}` that is about
        :math:`10^{-14}` at the mean, up to :math:`7 \cdot 10^{-10}` three standard deviations away and
        :math:`6 \cdot 10^{-9}` at fifty; at :math:`k = 2^{50}`, :math:`2 \cdot 10^{-8}` and :math:`3 \cdot 10^{-7}`
        (a relative error below :math:`10^{-11}` of the log-pmf there).

        Off the support, as :meth:`ConstrainedNormal.log_prob <hardeq.ConstrainedNormal.log_prob>` off the
        plane: with validation on (``validate_args``), a ``value`` with negative or non-integer entries, or
        whose group sums differ from the totals, raises ``ValueError`` (naming the position, the sums
        received and the totals expected); with validation off it gets :math:`-\infty` (the pmf is 0), as does
        every value when a total is not a non-negative integer; never NaN for a positive finite ``rate``.

        Args:
            value (Tensor): counts, shape ``(*sample, *batch, n)``.

        Returns:
            Tensor: ``(*sample, *batch)``, differentiable in ``rate``. Cost: O(n).

        Raises:
            ValueError: with validation on, ``value`` off the support (see above).
        """
        if self._validate_args:
            self._validate_sample(value)
        # p in float64 from the rates themselves: a float32 p is off by ~6e-8 relative, i.e. by ~k 6e-8 in the log
        p = group_probs(self._unbroadcasted_rate.to(torch.float64), self.index, self.num_groups)
        if not value.is_floating_point():
            value = value.to(torch.float64)
        value = value.detach()
        logp = multinomial_log_pmf(value, p, self.index, self._group_total.detach()).to(self.rate.dtype)
        in_support = _GroupedMultinomial(self._group_total, self.index).check(value)
        return logp.masked_fill(~in_support, float("-inf"))

    def entropy(self) -> Tensor:
        r"""Entropy of the product of multinomials (w.r.t. counting measure), shape ``batch_shape``, exact to
        float64 round-off by summation over each coordinate's binomial marginal.

        The multinomial pmf is :math:`\prod_i \mathrm{Poi}(z_i; k p_i) / \mathrm{Poi}(k; k)` on
        :math:`\sum_i z_i = k`, so with :math:`T(x; M) = -\log\mathrm{Poi}(x; M)` and
        :math:`Z_i \sim \mathrm{Bin}(k_{g(i)}, p_i)` (the marginals; the expectation of a sum needs no joint law)

        .. math::
            H = \sum_j \log\mathrm{Poi}(k_j; k_j) + \sum_i \mathbb E\, T(Z_i; k_{g(i)} p_i),

        each term in Loader's form (:math:`\log\mathrm{Poi}(k; k) = -\delta(k) - \tfrac12\log 2\pi k`,
        :math:`T(x; M) = \delta(x) + \tfrac12\log 2\pi x + \mathrm{bd0}(x, M)`, :math:`T(0; M) = M`; see
        :func:`hardeq.ops.multinomial_log_pmf`), of size :math:`O(\log k)`: nothing of size :math:`k\log k`
        cancels: against 50-digit sums it is within :math:`6\cdot10^{-15}` relative for binomials at totals of
        :math:`10^6`, :math:`10^8`, :math:`10^{12}` and :math:`2^{50}` (the tests hold it to :math:`10^{-12}`).
        The expectation sums :math:`b(x; k, p_i)\,T(x)` in float64 over the window :math:`|x - kp_i| \le t` with
        Bernstein's bound :math:`P(|Z - kp| \ge t) \le e^{-60}` on each side: the neglected terms add below
        :math:`10^{-23}` (:math:`T - \mathbb E T` is :math:`O(t^2 / v)` there), far below float64 rounding;
        :math:`W_i \le \min(k + 1,\ 22\sqrt{k p_i (1 - p_i)} + 84)` terms.

        Differentiable in ``rate``: :math:`\partial_{p}\,\mathbb E\,T(Z; kp) = \mathrm{Cov}(T(Z), Z) /
        (p(1 - p))` (the term :math:`\mathbb E\,\partial_p T = \mathbb E[k - Z/p]` vanishes), summed alongside
        (first derivatives only).

        Cost: O(:math:`\sum_i W_i`) time over all coordinates and batch elements, memory bounded by chunks of
        :math:`2^{20}` terms; e.g. 200 coordinates at :math:`k = 10^6` with equal rates take :math:`1.1\cdot10^5`
        terms, three at :math:`k = 10^{10}` take :math:`6\cdot10^6`... see the limit below: one coordinate at
        :math:`k = 10^{12}`, :math:`p = 1/2` would take :math:`1.1\cdot10^7`.

        Raises:
            ValueError: when :math:`\sum_i W_i` exceeds :data:`ENTROPY_MAX_TERMS` (:math:`2^{22}`), naming the
                limit, the terms needed and the largest total; a total that is not a non-negative integer
                (:math:`\le 2^{53}`), or a rate that is not positive and finite (the pmf is undefined).
        """
        rate = self._unbroadcasted_rate
        total = self._group_total
        bad_rate = ~(torch.isfinite(rate) & (rate > 0))
        ok = torch.isfinite(total) & (total >= 0) & (total == torch.floor(total)) & (total <= MAX_EXACT_COUNT)
        any_bad_rate, all_ok = torch.stack([bad_rate.any(), ok.all()]).tolist()  # (one host read for both)
        if any_bad_rate:
            raise ValueError(f"entropy: rate must be positive and finite, got {rate[bad_rate].flatten()[:5].tolist()} "
                             "among its entries.")
        if not all_ok:
            raise ValueError(f"entropy: total must hold non-negative integers up to 2**53, got "
                             f"{total[~ok].flatten()[:5].tolist()} among its entries (the pmf is 0 elsewhere).")
        p = group_probs(rate.to(torch.float64), self.index, self.num_groups)
        k = gather(total.to(torch.float64), self.index)
        p, k = torch.broadcast_tensors(p, k)  # shape: (*batch, n)
        expected: Tensor = _ExpectedNegLogPoisson.apply(  # type: ignore[no-untyped-call]  # torch: apply unannotated
            k.detach(), p)
        k_group = total.to(torch.float64).detach()
        ks = k_group.clamp(min=1)
        log_poi_kk = torch.where(k_group >= 1, -_stirlerr(ks) - 0.5 * torch.log(2 * torch.pi * ks), 0.0)
        out = log_poi_kk.sum(-1) + expected.sum(-1)
        return out.to(self.rate.dtype).expand(self.batch_shape)

    # ------------------------------------------------------------------------------------------ sampling
    def sample(self, sample_shape: _size = ()) -> Tensor:
        r"""Exact sample of the product of multinomials, a float tensor of counts in ``rate``'s dtype.

        Binary splitting with conditional binomials: the members of every group form a balanced binary
        tree (positions within the group, :class:`_SplitTree`), and a node holding :math:`c` counts sends

        .. math::
            c_L \sim \mathrm{Bin}\Big(c,\; \frac{\sum_{i \in L}\theta_i}{\sum_{i \in L \cup R}\theta_i}\Big),
            \qquad c_R = c - c_L

        to its children :math:`L, R`, starting from :math:`c = k_j` at the root of group :math:`j`. This is the
        multinomial exactly (a multinomial's count on a subset is binomial, and given it the two subsets are
        independent multinomials), and the right child takes the remainder, so every sample sums **exactly**
        to its totals. One vectorised step per tree level, for all groups, samples and batch elements at once:
        :math:`\lceil\log_2 \max_j |G_j|\rceil` steps. Subtree weights are sums of positive rates in float64,
        so the ratios need no cancelling subtraction; they are clamped to ``[0, 1]``. Draws use
        :func:`hardeq.ops.binomial_sample` (``torch.binomial``, counts above :math:`2^{40}` in chunks).

        Cost: O(S B n) time and memory (about :math:`2 S B n` binomial draws, at most
        :math:`\lceil \max k / 2^{40}\rceil` each), with S = ``sample_shape.numel()``, B = ``batch_shape.numel()``,
        **independent of the totals**. Totals up to :math:`2^{53}` are exact in float64; with a float32 rate
        (exact integers up to :math:`2^{24}`), a larger total is a ``ValueError`` at construction (use float64).

        Raises:
            ValueError: a total that is not a non-negative integer :math:`\le 2^{53}` (3.5 cannot be met by
                integer counts), or a rate that is not positive and finite; checked here **even with**
                ``validate_args=False``.

        Returns:
            Tensor: ``(*sample_shape, *batch, n)``.
        """
        with torch.no_grad():
            return self._sample(torch.Size(sample_shape))

    def rsample(self, sample_shape: _size = (), estimator: str = "marginal_expectation") -> Tensor:
        r"""The exact sample of :meth:`sample`, carrying the gradient w.r.t. ``rate`` of ``estimator``.

        Args:
            sample_shape (torch.Size): leading sample dimensions.
            estimator (str): one of ``"marginal_expectation"`` (proxy :math:`k p`), ``"constrained_marginal"``
                (binomial pmf at the sample), ``"unconstrained_marginal"`` (Poisson pmf at the sample),
                ``"random"`` (N(0, I) in place of the gradient). All biased; see
                ``hardeq.estimators.poisson``.

        Returns:
            Tensor: ``(*sample_shape, *batch, n)``, equal to an exact sample.

        Raises:
            ValueError: unknown ``estimator``.
        """
        fn = get_estimator(estimator, family="poisson")
        z = self.sample(sample_shape)
        return fn(self._unbroadcasted_rate, self.total, z, index=self.index)

    def _sample(self, sample_shape: torch.Size) -> Tensor:
        n, a = self.event_shape[0], self.num_groups
        batch = self.batch_shape
        B, S = batch.numel(), sample_shape.numel()
        device = self.rate.device
        shape = sample_shape + batch + (n,)
        rate = self.rate.detach()
        total = self._group_total.detach()
        num_chunks = _check_sampling_parameters(rate, total)  # (the one host read of a sample)
        if S == 0 or B == 0:
            return torch.zeros(shape, dtype=self.rate.dtype, device=device)
        tree = self._layout
        # Node weights, level 0 = the coordinates in group-sorted order; a parent's weight is the sum of its
        # children's (positive terms: no cancellation), so the split ratios lie in [0, 1] up to round-off.
        weights = [rate.to(torch.float64).reshape(B, n).index_select(-1, tree.perm)]
        for parent, num_parents in zip(tree.parent, tree.num_nodes[1:], strict=True):
            w = weights[-1]
            weights.append(w.new_zeros(B, num_parents).index_add_(-1, parent, w))
        counts = total.to(torch.float64).reshape(1, B, a).expand(S, B, a)  # the top level: one node per group
        for level in range(tree.depth, 0, -1):
            parent, left, paired = tree.parent[level - 1], tree.is_left[level - 1], tree.paired[level - 1]
            at_parent = counts.index_select(-1, parent)  # shape: (S, B, M) for the M children
            ratio = (weights[level - 1] / weights[level].index_select(-1, parent)).clamp_(0.0, 1.0)
            # left children with a sibling; no count exceeds the largest total, whose chunks are known
            draw = binomial_sample(torch.where(paired, at_parent, 0.0), ratio, num_chunks=num_chunks)
            sibling = torch.nn.functional.pad(draw[..., :-1], (1, 0))  # a right child's left sibling's draw
            counts = torch.where(left, torch.where(paired, draw, at_parent), at_parent - sibling)
        out = counts.index_select(-1, tree.inverse_perm)
        return out.reshape(shape).to(self.rate.dtype)


def _check_sampling_parameters(rate: Tensor, total: Tensor) -> int:
    """Parameters the sampler cannot honour raise, whatever ``validate_args`` says (a total of 3.5 cannot be
    met by integer counts; a non-positive rate has no multinomial). Returns the chunks of
    :func:`~hardeq.ops.binomial_sample` the largest total needs. One host read (the verdicts and the largest
    total together); more only to name what failed."""
    rate_ok = (torch.isfinite(rate) & (rate > 0)).all()
    total_ok = (torch.isfinite(total) & (total >= 0) & (total == torch.floor(total))).all()
    largest = total.amax() if total.numel() else total.new_zeros(())
    rate_good, total_good, top = torch.stack([rate_ok.to(torch.float64), total_ok.to(torch.float64),
                                              largest.to(torch.float64)]).tolist()
    if rate_good and total_good and top <= MAX_EXACT_COUNT:
        return max(1, -(-int(top) // BINOMIAL_CHUNK))
    if not bool(torch.isfinite(rate).all() and (rate > 0).all()):
        bad = rate[~(torch.isfinite(rate) & (rate > 0))]
        raise ValueError(
            f"cannot sample: rate must be positive and finite, got {bad.flatten()[:5].tolist()} among its "
            "entries (sampling checks this even with validate_args=False)."
        )
    ok = torch.isfinite(total) & (total >= 0) & (total == torch.floor(total))
    if not bool(ok.all()):
        raise ValueError(
            f"cannot sample: total must hold non-negative integers (the sums of integer counts), got "
            f"{total[~ok].flatten()[:5].tolist()} among its entries (sampling checks this even with "
            "validate_args=False; round the totals first)."
        )
    if bool((total > MAX_EXACT_COUNT).any()):
        raise ValueError(
            f"cannot sample: total must be at most 2**53 = {MAX_EXACT_COUNT} (the largest count float64 holds "
            f"exactly), got {total.max().item():.6g}."
        )
    raise AssertionError("unreachable: a failed verdict above raises")  # pragma: no cover


class _SplitTree(NamedTuple):
    r"""Binary splitting tree of every group, built once per ``index``.

    The members of group :math:`g` (in coordinate order) get positions :math:`0 .. s_g - 1`; at level
    :math:`\ell` a node is a pair :math:`(g, h)` holding the members with ``position >> l == h``. Level 0
    is the coordinates, level ``depth`` = :math:`\lceil\log_2 \max_g s_g\rceil` one node per group. Nodes of
    a level are numbered group by group (``offset_l[g] + h``), so level 0 is the group-sorted order ``perm``
    and a right child ``c`` (odd ``h``) has its left sibling at ``c - 1``. Per level ``l = 1..depth``, for
    the children at level ``l - 1``: ``parent`` (their node at level ``l``), ``is_left`` (even ``h``) and
    ``paired`` (a left child with a right sibling). Size: at most :math:`2n + a \cdot \mathrm{depth}` nodes.
    """

    perm: Tensor
    inverse_perm: Tensor
    depth: int
    num_nodes: list[int]
    parent: list[Tensor]
    is_left: list[Tensor]
    paired: list[Tensor]


#: per index tensor, ``{num_groups: _SplitTree}``: a training loop builds the distribution each step on the same
#: ``index``, whose check (values in range, no empty group) and tree are made once
_TREES = PerTensorCache(snapshot_on_reuse=True)


def _split_tree_of(index: Tensor | None, n: int, num_groups: int, device: torch.device, validate: bool) -> _SplitTree:
    """The checked tree of ``index`` (:func:`check_group_index`, then :func:`_split_tree`), remembered per index
    tensor while it lives unchanged (:mod:`hardeq.constraints._cache`: with validation the lookup compares the
    contents, on the host on a CPU and on the device where a read-back synchronises; without, the version), and per
    ``(n, device)`` without an index."""
    if index is None:
        return _single_group_tree(n, device)
    if is_tracing():
        check_group_index(index, num_groups)
        return _split_tree(index, n, num_groups, device)
    with no_host_reads(not lookup_on_host(validate, index.device)):
        trees = _TREES.get(index, trust_version=not validate)
    tree = None if trees is None else trees.get(num_groups)
    if tree is None:
        check_group_index(index, num_groups)
        tree = _split_tree(index, n, num_groups, device)
        if trees is None:
            trees = {}
            _TREES.put(index, trees)
        trees[num_groups] = tree
    return tree


@functools.lru_cache(maxsize=16)
def _single_group_tree(n: int, device: torch.device) -> _SplitTree:
    """The tree of one group of ``n`` members (no ``index``)."""
    return _split_tree(None, n, 1, device)


def _split_tree(index: Tensor | None, n: int, num_groups: int, device: torch.device) -> _SplitTree:
    if index is None:
        index = torch.zeros(n, dtype=torch.long, device=device)
    perm = torch.argsort(index, stable=True)
    inverse_perm = torch.empty_like(perm)
    inverse_perm[perm] = torch.arange(n, device=device)
    sizes = torch.bincount(index, minlength=num_groups)
    max_size = int(sizes.max().item()) if n else 0
    depth = max(0, (max_size - 1).bit_length())
    groups = torch.arange(num_groups, device=device)
    num_nodes, parent, is_left, paired = [], [], [], []
    per_group = sizes  # nodes per group at the current level
    for level in range(depth + 1):
        num_nodes.append(int(per_group.sum().item()))
        if level == depth:
            break
        up = -(-sizes // 2 ** (level + 1))  # nodes per group one level up
        offset = torch.cumsum(per_group, 0) - per_group
        up_offset = torch.cumsum(up, 0) - up
        group = torch.repeat_interleave(groups, per_group)
        h = torch.arange(num_nodes[-1], device=device) - offset[group]
        parent.append(up_offset[group] + h // 2)
        is_left.append(h % 2 == 0)
        paired.append((h % 2 == 0) & (h + 1 < per_group[group]))
        per_group = up
    return _SplitTree(perm, inverse_perm, depth, num_nodes, parent, is_left, paired)


def _entropy_window(k: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    r"""``lo``, ``hi`` (inclusive, within ``0..k``): the x with :math:`|x - kp| \le t`, :math:`t^2 = 2c(v + t/3)`,
    :math:`c = 60`, :math:`v = kp(1 - p)`; by Bernstein's inequality each tail outside has probability below
    :math:`e^{-60} \approx 10^{-26}`."""
    mean = k * p
    c = 60.0
    t = (2 * c / 3 + torch.sqrt((2 * c / 3) ** 2 + 8 * c * mean * (1 - p))) / 2
    lo = torch.floor(mean - t - 1).clamp(min=0)
    hi = torch.minimum(torch.ceil(mean + t + 1), k)
    return lo, hi


def _neg_log_poisson(x: Tensor, mean: Tensor) -> Tensor:
    r""":math:`T(x; M) = -\log\mathrm{Poi}(x; M)` in Loader's form, float64: :math:`M` at :math:`x = 0`,
    :math:`\delta(x) + \tfrac12\log 2\pi x + \mathrm{bd0}(x, M)` for :math:`x \ge 1` (``mean > 0`` there)."""
    pos = x >= 1
    xs = torch.where(pos, x, torch.ones_like(x))
    ms = torch.where(pos, mean, torch.ones_like(mean))
    return torch.where(pos, _stirlerr(xs) + 0.5 * torch.log(2 * torch.pi * xs) + _bd0(xs, ms), mean)


class _ExpectedNegLogPoisson(torch.autograd.Function):
    r""":math:`\mathbb E\,T(Z; kp)` for :math:`Z \sim \mathrm{Bin}(k, p)`, elementwise over broadcast float64
    ``(k, p)``, summed over :func:`_entropy_window`; differentiable in ``p`` (once) with
    :math:`\mathrm{Cov}(T(Z), Z) / (p(1 - p))`, 0 where :math:`p \in \{0, 1\}` (a point mass)."""

    @staticmethod
    def forward(ctx: Any, k: Tensor, p: Tensor) -> Tensor:
        shape = p.shape
        k, p = k.reshape(-1), p.detach().reshape(-1)
        lo, hi = _entropy_window(k, p)
        width = (hi - lo + 1).clamp(min=1).to(torch.long)
        num_terms = int(width.sum().item()) if width.numel() else 0
        if num_terms > ENTROPY_MAX_TERMS:
            raise ValueError(
                f"ConstrainedPoisson.entropy would sum {num_terms} binomial pmf terms (about 22 sqrt(k p (1 - p)) + "
                f"84 per coordinate, at most k + 1), above the limit ENTROPY_MAX_TERMS = {ENTROPY_MAX_TERMS} "
                f"(hardeq.distributions.poisson); the largest total is k = {k.max().item():.6g}. Compute it for "
                "fewer batch elements at a time."
            )
        ends = torch.cumsum(width, 0)
        starts = ends - width
        mean = k * p
        s_t = torch.zeros_like(p)  # sum b T
        s_tz = torch.zeros_like(p)  # sum b T (x - kp)
        s_z = torch.zeros_like(p)  # sum b (x - kp)
        for start in range(0, num_terms, _ENTROPY_CHUNK):  # loop over chunks of terms, not over coordinates
            pos = torch.arange(start, min(num_terms, start + _ENTROPY_CHUNK), device=p.device)
            e = torch.searchsorted(ends, pos, right=True)  # the coordinate of each term
            x = lo[e] + (pos - starts[e]).to(torch.float64)
            b = binomial_log_pmf(x, k[e], p[e]).exp()
            bt = b * _neg_log_poisson(x, mean[e])
            dx = x - mean[e]
            s_t.index_add_(0, e, bt)
            s_tz.index_add_(0, e, bt * dx)
            s_z.index_add_(0, e, b * dx)
        interior = (p > 0) & (p < 1)
        ctx.save_for_backward(torch.where(interior, (s_tz - s_t * s_z) / (p * (1 - p)).clamp(min=1e-300), 0.0)
                              .reshape(shape))
        return s_t.reshape(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, Tensor]:
        (slope,) = ctx.saved_tensors
        return None, grad_output * slope
