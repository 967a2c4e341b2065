r"""Sample-then-repair baselines: make a network output satisfy :math:`A y = k` after the fact.

All of them work on the same constraint objects as the rest of hardeq and are differentiable:

=========================  ===================================================================  ===========
layer / function           what it does                                                         reference
=========================  ===================================================================  ===========
:class:`KKTProjection`     orthogonal projection :math:`y - A^\top(AA^\top)^{-1}(Ay - k)`       KKT-hPINN
:class:`ConstraintLayer`   solve each equality for its highest-ranked variable (elimination)    CL
:class:`EqualityCompletion` solve :math:`A_D y_D = k - A_I y_I` for fixed dependent columns      ECNN
:func:`penalty_loss`       soft penalty :math:`w\|Ay - k\|^2` to add to a data loss             PINN
=========================  ===================================================================  ===========

API. The layers are ``nn.Module``\ s built from the constraint matrix ``A`` (``(*batch, a, n)``, checked
once: full row rank, ``a < n``; stored with the precomputed factors as buffers, so ``.to()`` / ``.double()``
move them) and called with the right-hand side per call, ``layer(y, k)``; ``k`` (``(*batch, a)``) may differ
per sample, e.g. ``k = b - B x`` for inputs ``x``. ``Layer.from_constraint(c)`` builds one from any
constraint object (its matrix materialised with ``c.dense_rows()``) and keeps ``c.k`` as the default
``k`` (``layer(y)``). Each call checks ``y`` and ``k`` (dtype, device, last dimension) and names the bad
argument. The functional forms :func:`kkt_projection`, :func:`constraint_layer` and :func:`penalty_loss`
take a constraint object instead.

Example:
    >>> import torch
    >>> from hardeq import LinearConstraint
    >>> from hardeq.baselines import ConstraintLayer, KKTProjection, EqualityCompletion, penalty_loss
    >>> A = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, -1.0, 2.0]])   # shared constraint matrix
    >>> B = torch.tensor([[1.0], [0.5]]); b = torch.tensor([2.0, 0.0])
    >>> x = torch.randn(8, 1)                                             # inputs of a batch
    >>> k = b - x @ B.T                                                   # per-sample k = b - B x, (8, 2)
    >>> y = torch.randn(8, 4, requires_grad=True)                         # network outputs, (8, 4)
    >>> c = LinearConstraint(A, k)
    >>> for layer in (KKTProjection(A), ConstraintLayer(A), EqualityCompletion(A)):
    ...     out = layer(y, k)
    ...     assert out.shape == (8, 4) and bool(c.check(out).all())
    >>> KKTProjection(A)
    KKTProjection(a=2, n=4)
    >>> loss = penalty_loss(y, c, weight=10.0)                            # soft alternative
    >>> loss.backward()
"""

from .completion import EqualityCompletion
from .elimination import ConstraintLayer, constraint_layer
from .estimator import constrained_layer_estimator  # noqa: F401  (registers the "constrained_layer" estimator)
from .penalty import penalty_loss
from .projection import KKTProjection, kkt_projection

__all__ = [
    "ConstraintLayer",
    "EqualityCompletion",
    "KKTProjection",
    "constraint_layer",
    "kkt_projection",
    "penalty_loss",
]
