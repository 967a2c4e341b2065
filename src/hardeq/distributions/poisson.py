r"""Independent Poissons conditioned on their (grouped) sums: products of multinomials."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor
from torch.distributions import Binomial, Distribution, constraints

from .._utils import check_finite, check_group_index
from ..constraints import EqualityConstraint, SumConstraint
from ..estimators import poisson as _poisson_estimators  # noqa: F401  (registers the estimators)
from ..ops import gather, group_probs, group_sum
from ..estimators.registry import get_estimator
from .poisson_losses import binomial_expected_l1, binomial_expected_l2

__all__ = ["ConstrainedPoisson", "grouped_multinomial"]

_size = torch.Size | tuple[int, ...]


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
    counting measure on :math:`\mathbb N^n`): the product of the groups' multinomial pmfs, :math:`-\infty` for
    count vectors whose group sums differ from the totals.

    Sampling is exact; :meth:`rsample` returns the same exact sample with the gradient w.r.t. ``rate`` of the
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
            integer, ``log_prob`` arguments non-negative integers), as in ``torch.distributions``; defaults to
            torch's global setting. Types, shapes and ``index`` are always checked.

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
            raise TypeError(f"rate must be a torch.Tensor, got {type(rate).__name__}.")
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
            check_group_index(index, num_groups)
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
        self._layout = _group_layout(index, n, num_groups, rate.device)
        super().__init__(batch_shape, torch.Size([n]), validate_args=validate_args)
        if self._validate_args:
            check_finite("rate", rate)

    # ------------------------------------------------------------------------------------------ shapes
    def expand(self, batch_shape: _size, _instance=None) -> ConstrainedPoisson:
        new = self._get_checked_instance(ConstrainedPoisson, _instance)
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
        ``torch.distributions.Binomial`` of batch shape ``(*batch, n)`` (the coordinates are dependent)."""
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

        Cost: O(N (max y + 1)) time for N = the output's size (a float64 cumulative sum of pmf values for the
        cdf, memory bounded by chunks of 2^20 terms): fine for totals up to a few thousand.
        """
        y = self._check_target(y)
        return binomial_expected_l1(y, self._coordinate_total, self.probs)

    # ------------------------------------------------------------------------------------------ density
    def _validate_sample(self, value: Tensor) -> None:
        # Shapes, and values that are non-negative integers. Group sums are *not* validated: the pmf is 0
        # there, so log_prob returns -inf (use ``support.check`` for the full support test).
        if not isinstance(value, Tensor):
            raise TypeError(f"value must be a torch.Tensor, got {type(value).__name__}.")
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
        v = value if value.is_floating_point() else value.to(self.rate.dtype)
        if not bool(((v >= 0) & (v == torch.floor(v))).all()):
            raise ValueError(
                f"Expected value (Tensor of shape {tuple(value.shape)}) to hold non-negative integer counts, "
                f"but found invalid values:\n{value}"
            )

    def log_prob(self, value: Tensor) -> Tensor:
        r"""Multinomial log-pmf, summed over the groups:

        .. math::
            \log p(z) = \sum_j \Big[\log k_j! - \sum_{i \in G_j} \log z_i!\Big] + \sum_i z_i \log p_i

        for non-negative integer ``z`` with the right group sums, :math:`-\infty` otherwise.

        Args:
            value (Tensor): counts, shape ``(*sample, *batch, n)``.

        Returns:
            Tensor: ``(*sample, *batch)``, differentiable in ``rate``. Cost: O(n).
        """
        if self._validate_args:
            self._validate_sample(value)
        p = self.probs
        if not value.is_floating_point():
            value = value.to(p.dtype)
        value = value.detach()
        logp = (
            torch.xlogy(value, p).sum(-1)
            - torch.lgamma(value.clamp(min=0) + 1).sum(-1)
            + torch.lgamma(self._group_total + 1).sum(-1)
        )
        in_support = _GroupedMultinomial(self._group_total, self.index).check(value)
        return logp.masked_fill(~in_support, float("-inf"))

    # ------------------------------------------------------------------------------------------ sampling
    def sample(self, sample_shape: _size = ()) -> Tensor:
        r"""Exact sample of the product of multinomials, a float tensor of counts in ``rate``'s dtype.

        Every total :math:`k_j` is realised as :math:`k_j` categorical draws restricted to its group (inverse
        cdf: ``torch.searchsorted`` on within-group cumulative probabilities, offset by the group's position
        so that one sorted sequence serves all batch elements and groups), then counted with ``bincount``.
        Every sample sums exactly to its totals. Vectorised over sample, batch and groups (no Python loop).

        Cost: O(B n + S K log(B n)) time and O(B n + S K) memory, with S = ``sample_shape.numel()``,
        B = ``batch_shape.numel()`` and K the sum of all B a totals (so linear in the totals; for totals in
        the millions a conditional-binomial splitting would be cheaper). The search runs in float64 on keys
        ``group offset + cumulative probability``, so probabilities are resolved to about
        :math:`2^{-52} B a`; counts are exact integers (in float32 up to :math:`2^{24}` per coordinate).

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
        totals = torch.round(self._group_total.detach()).long().reshape(B * a)  # shape: (B a,)
        if S == 0 or B == 0 or int(totals.sum()) == 0:
            return torch.zeros(shape, dtype=self.rate.dtype, device=device)
        perm, sorted_index, starts, ends = self._layout
        # Within-group cumulative probabilities, in the group-sorted coordinate order, float64.
        p = self.probs.detach().to(torch.float64).reshape(B, n)[:, perm]  # shape: (B, n)
        cum = p.cumsum(-1)
        before = torch.cat([cum.new_zeros(B, 1), cum[:, :-1]], -1)
        within = (cum - before[:, starts].index_select(-1, sorted_index)).clamp_(max=1.0)
        within[:, ends - 1] = 1.0  # each group's last interval ends exactly at 1
        # Offset group (b, g) by b a + g: one non-decreasing sequence over all batch elements and groups.
        group_id = torch.arange(B, device=device).unsqueeze(-1) * a + sorted_index  # shape: (B, n)
        keys = (group_id.to(torch.float64) + within).reshape(-1)  # shape: (B n,)
        draw_group = torch.repeat_interleave(torch.arange(B * a, device=device), totals)  # shape: (K,)
        u = torch.rand((S, draw_group.numel()), dtype=torch.float64, device=device)
        pos = torch.searchsorted(keys, draw_group.to(torch.float64) + u, right=True)  # shape: (S, K)
        b, g = draw_group // a, draw_group % a
        lo, hi = b * n + starts[g], b * n + ends[g] - 1  # round-off guard: stay inside the draw's group
        pos = torch.minimum(torch.maximum(pos, lo), hi)
        coord = (pos // n) * n + perm[pos % n]  # flat (b, i) in the original coordinate order
        coord = coord + torch.arange(S, device=device).unsqueeze(-1) * (B * n)
        counts = torch.bincount(coord.reshape(-1), minlength=S * B * n)
        return counts.reshape(shape).to(self.rate.dtype)


def _group_layout(
    index: Tensor | None, n: int, num_groups: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group-sorted order of the coordinates: ``perm`` (n,), ``index[perm]`` (n,), and every group's
    ``starts``/``ends`` (a,) in that order."""
    if index is None:
        index = torch.zeros(n, dtype=torch.long, device=device)
    perm = torch.argsort(index, stable=True)
    ends = torch.bincount(index, minlength=num_groups).cumsum(0)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return perm, index[perm], starts, ends
