r"""Post-processing baselines: sample unconstrained, then repair the final :math:`x_0`.

* ``"project"``: the orthogonal (KKT) projection onto :math:`\{Ax = k\}` after the last step,
  :math:`x \leftarrow x - A^\top(AA^\top)^{-1}(Ax - k)` (:func:`project_onto`; KKT-hPINN). Satisfies the
  constraint to round-off, but the result is no longer a sample of any model-derived conditional.
* ``"project_clip"``: the projection followed by clipping to the data range ``[lo, hi]``
  (e.g. ``[-1, 1]``). Clipping moves pixels independently and **breaks the constraint again** (that is the
  point of this baseline: the usual "project, then clip to the valid range" pipeline is not exact).
* ``"clip"``: clipping only (diffusers' ``clip_sample`` applied to the output).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ..baselines.projection import kkt_projection
from ..constraints import EqualityConstraint
from .image_constraints import check_image_constraint

__all__ = ["project_onto", "clip_to", "project_and_clip", "resolve_post", "POST_OPTIONS"]

POST_OPTIONS = ("project", "project_clip", "clip")


def project_onto(constraint: EqualityConstraint, x: Tensor) -> Tensor:
    r"""Orthogonal projection of the images ``x`` ``(B, *image_shape)`` onto :math:`\{Ax = k\}` (flattened):
    :math:`x - A^\top(AA^\top)^{-1}(Ax - k)`; O(n) for a :class:`~hardeq.SumConstraint` (for a channel sum:
    subtract the mean excess of each channel). Same shape as ``x``; exact to round-off.

    Examples:
        >>> c = channel_sum_constraint((1, 1, 2, 2), [3.0])
        >>> x = torch.tensor([[[[0.9, 0.8], [0.1, -0.5]]]])  # sum 1.3: each pixel moves by (3 - 1.3) / 4
        >>> y = project_onto(c, x)
        >>> y, bool(satisfies_constraint(y, c))
        (tensor([[[[ 1.3250,  1.2250],
                  [ 0.5250, -0.0750]]]]), True)
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"project_onto: x must be a torch.Tensor, got {type(x).__name__}.")
    con = check_image_constraint(constraint, x, owner="project_onto")
    flat = x.reshape(x.shape[0], -1)
    return kkt_projection(flat, con).reshape(x.shape)


def clip_to(x: Tensor, lo: float = -1.0, hi: float = 1.0) -> Tensor:
    """``x`` clamped to ``[lo, hi]`` elementwise (breaks any equality constraint the input satisfied).

    Examples:
        >>> clip_to(torch.tensor([[[[0.9, 0.8], [0.1, -0.5]]]]), 0.0, 0.5)
        tensor([[[[0.5000, 0.5000],
                  [0.1000, 0.0000]]]])
    """
    if not lo < hi:
        raise ValueError(f"clip range must have lo < hi, got ({lo}, {hi}).")
    return x.clamp(lo, hi)


def project_and_clip(constraint: EqualityConstraint, x: Tensor, lo: float = -1.0, hi: float = 1.0) -> Tensor:
    """:func:`project_onto` then :func:`clip_to`: the common repair pipeline, which is *not* exact (the clip undoes
    part of the projection).

    Examples:
        >>> c = channel_sum_constraint((1, 1, 2, 2), [3.0])
        >>> y = project_and_clip(c, torch.tensor([[[[0.9, 0.8], [0.1, -0.5]]]]))
        >>> y, round(float(channel_sums(y)), 4), bool(satisfies_constraint(y, c))  # the clip undoes part of it
        (tensor([[[[ 1.0000,  1.0000],
                  [ 0.5250, -0.0750]]]]), 2.45, False)
    """
    return clip_to(project_onto(constraint, x), lo, hi)


def resolve_post(post: str | Callable[[Tensor], Tensor] | None, constraint: EqualityConstraint | None,
                 clip_range: tuple[float, float]) -> Callable[[Tensor], Tensor] | None:
    """The post-processing map of a sampler's ``post=`` option (``None``, a name of :data:`POST_OPTIONS`, or a
    callable ``x0 -> x0``)."""
    if post is None:
        return None
    if callable(post):
        return post
    if post not in POST_OPTIONS:
        raise ValueError(f"post must be None, a callable x0 -> x0 or one of {POST_OPTIONS}, got {post!r}.")
    if (not isinstance(clip_range, (tuple, list)) or len(clip_range) != 2
            or not float(clip_range[0]) < float(clip_range[1])):
        raise ValueError(f"clip_range must be a pair (lo, hi) with lo < hi, got {clip_range!r}.")
    lo, hi = float(clip_range[0]), float(clip_range[1])
    if post == "clip":
        return lambda x: clip_to(x, lo, hi)
    if constraint is None:
        raise ValueError(f"post={post!r} projects onto the constraint, but constraint is None.")
    if post == "project":
        return lambda x: project_onto(constraint, x)
    return lambda x: project_and_clip(constraint, x, lo, hi)

