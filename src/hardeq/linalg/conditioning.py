r"""Conditioning a Gaussian on a linear equality constraint (Matheron's rule), without forming ``n x n``.

Notation: :math:`\Sigma = FF^\top` (``F``: ``n x m``, ``diag(scale)``, ``scale_tril`` or ``[diag(scale), W]``),
:math:`S = A\Sigma A^\top` (``a x a``), gain :math:`K = \Sigma A^\top S^{-1}`. The Matheron map

.. math::
    z = \hat z + K(k - A\hat z)

sends :math:`\hat z \sim \mathcal N(\mu, \Sigma)` to an exact sample of :math:`z \mid Az = k` and :math:`\mu` to
the conditional mean. Everything below is about computing it *to round-off* and fast.

**Scaling.** :math:`K` is invariant to :math:`\Sigma \to \Sigma / c^2`, so the factorisation works with the
normalised :math:`\Sigma' = \Sigma / c^2`, :math:`c` = the largest entry of ``F`` per batch element; scales of
1e-20 or 1e-40 in float32 neither under- nor overflow (:math:`\log\det S` adds :math:`2a\log c` back).

**Algorithms, chosen once per covariance/constraint pair in** :meth:`Conditioner._factorise`:

* ``"grouped"``: the constraint says its Gram matrix is diagonal under a diagonal covariance
  (:meth:`~hardeq.constraints.EqualityConstraint.diagonal_gram`, e.g. a :class:`~hardeq.SumConstraint`):
  :math:`S = \mathrm{diag}(s)`, :math:`Kr = v \odot A^\top(r / s)`, O(n) per vector.
* ``"cholesky"``: the Gram matrix :math:`S' = A\Sigma' A^\top` by one (batched) GEMM, accumulated in the working
  dtype, and its Cholesky factor :math:`S' = LL^\top`. Per-sample diagonal covariance with a shared ``A`` and
  small ``a``: one GEMM ``v' @ P`` with the ``n x a(a+1)/2`` row products ``P`` of ``A``; otherwise chunked
  batched GEMMs, so no ``batch x n x a`` tensor lives longer than one chunk.
* ``"cholesky64"``: the same in float64 for a float32 input, chosen when the float32 factor is not accurate
  enough: its Cholesky fails or the pivot ratio says :math:`\kappa(S) \ge (\max L_{jj}/\min L_{jj})^2 > 10^3`
  (then :math:`\varepsilon_{32}\kappa(S)` would cost more than one refinement step). The ``a x a`` factor, the
  solves and the gain product :math:`\Sigma'A^\top x` are float64 (the entries of :math:`x = S'^{-1}r` cancel in
  that product when :math:`\kappa` is large); the samples stay float32.
* ``"qr"``: the backward-stable fallback, a Householder QR :math:`B^\top = QR` of :math:`B = AF'` (in float64 for a
  float32 input), :math:`Kr = F'QR^{-\top}r`. Chosen when the float64 Cholesky fails or its pivot ratio gives
  :math:`\kappa(S) > 10^{10}` (rows of ``A`` nearly dependent under :math:`\Sigma`, scales spanning more than eight
  decades); it keeps ``Q`` (``batch x m x a``), the only path that does.
* ``"nullspace"``: a dense constraint with ``n - a < a`` (``A`` without gradient, a known covariance type). On
  top of one of the factors above (kept for :meth:`~Conditioner.whiten`, :meth:`~Conditioner.inv_quad`,
  :meth:`~Conditioner.logdet`, :meth:`~Conditioner.gain_factor`), in float64: a complete QR
  :math:`A^\top = [Q_A, N][R; 0]` gives an orthonormal basis ``N`` of :math:`\mathrm{null}(A)` (``n x p``,
  ``p = n - a``) and :math:`z_p = Q_A R^{-\top}k`; with :math:`M' = N^\top\Sigma'^{-1}N = L_ML_M^\top`,
  :math:`V = NL_M^{-\top}`, :math:`U = \Sigma'^{-1}V`, the Matheron map is :math:`z = z_p + VU^\top(\hat z - z_p)`,
  :math:`Kr = (I - VU^\top)Q_AR^{-\top}r` and the conditional covariance :math:`c^2VV^\top` (variances without
  cancellation). O(n p) per vector instead of O(n a); and :math:`Az - k = (Az_p - k) + (AN)t` is round-off for
  any :math:`\kappa(S)` (no ``ulp(ẑ)`` term, since :math:`\hat z` is not added back). A refinement step applies
  this :math:`K` to the float64 residual of ``z``; a sample still failing escalates to ``"qr"``.

**Residual check and refinement.** After the Matheron step the residual ``A z - k`` is compared with
``rtol * max_i (|A||z|)_i`` (``rtol = min(eps max(4, 2 sqrt(n)), cap)``, cap 2.5e-6 in float32 and 2.5e-13
in float64, a quarter of the exactness target; first against a cheap lower bound,
``max(max_i |(Az)_i|, min_j c_j ||z||_1 / a)`` with :math:`c_j = \sum_i |A_{ij}|`, then with the exact
``|A||z|`` only when that is inconclusive, and for float32
finally with the residual re-evaluated in float64, so that evaluation noise never asks for a useless step).
Only samples that fail get a refinement step :math:`z \leftarrow z + K(k - Az)` (up to
:data:`MAX_REFINEMENT_STEPS`); the map is a projection, so this changes neither the distribution nor, to first
order, the gradient. If a sample still fails, the conditioner escalates to the next algorithm
(``cholesky -> cholesky64 -> qr``, ``nullspace -> qr``, through :meth:`_factorise`) and, at ``qr``, raises
:class:`~hardeq.NotPSDError`. Refinement is needed when :math:`\hat z` is much larger than :math:`z` (ulp(ẑ)
absolute error: e.g. a group of one with scale 1e8 must return ``k``) or when :math:`\varepsilon\kappa(S)` is not
small.

Cost: factorisation O(batch n a^2 + batch a^3) (GEMM speed); each conditioned vector O(n a) (``grouped``: O(n)) plus
the check, one more O(n a) product and one O(n) norm. :meth:`sample` fuses ``loc + F eps`` and the Matheron step
in place when no gradient is needed (memory-bound at large ``n``: every avoided ``n``-sized temporary counts).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._utils import batch_mv
from ..errors import NotPSDError
from .covariance import Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance
from .triangular import tri_solve_vec

if TYPE_CHECKING:
    from ..constraints import EqualityConstraint

__all__ = ["Conditioner", "MAX_REFINEMENT_STEPS", "CHECK_RTOL_CAP"]

#: refinement steps allowed per algorithm before escalating to the next one
MAX_REFINEMENT_STEPS = 3
#: cap of the internal residual check's tolerance, relative to ``max_i (|A||z|)_i`` (a quarter of the
#: exactness target 1e-5 / 1e-12)
CHECK_RTOL_CAP = {torch.float32: 2.5e-6, torch.float64: 2.5e-13}
#: largest pivot-ratio estimate of kappa(S) accepted by the float32 / float64 Cholesky paths
_KAPPA_MAX_32 = 1e3
_KAPPA_MAX_64 = 1e10
#: elements of a transient (chunk x a x n) tensor
_CHUNK_ELEMS = 1 << 24
#: most groups for which grouped sums run as a GEMM with the one-hot matrix (O(a n)); beyond, the O(n)
#: scatter wins (a PyG batch of 128 graphs: 50x slower as a GEMM)
_ONEHOT_MAX_GROUPS = 16
#: largest n * a(a+1)/2 for the product-matrix Gram of a per-sample diagonal covariance
_PRODUCT_ELEMS = 1 << 25

_ORDER = ("cholesky", "cholesky64", "qr")


class Conditioner:
    r"""Everything about :math:`\mathcal N(\mu, \Sigma)` given :math:`A z = k` that does not depend on
    :math:`\mu` (and, for the factor, on :math:`k`): the factorisation of :math:`S`, the gain, conditional
    variances. See the module docstring for the algorithms and when each is chosen.

    Args:
        covariance: the structure of :math:`\Sigma` (batch shape ``B_s``).
        constraint: the constraint (batch shape ``B_c``); results broadcast over ``B_s`` and ``B_c``.

    Attributes:
        method (str): ``"grouped"``, ``"cholesky"``, ``"cholesky64"``, ``"qr"`` or ``"nullspace"``.
        grouped (bool): ``method == "grouped"``; then :attr:`group_variance` is the diagonal of :math:`S`,
            shape ``(*batch, a)``.

    Raises:
        NotPSDError: if :math:`S` is numerically singular (rows of ``A`` dependent under :math:`\Sigma`), or has
            NaN/inf entries.
    """

    def __init__(self, covariance: Covariance, constraint: "EqualityConstraint") -> None:
        if covariance.event_size != constraint.event_size:
            raise ValueError(
                f"covariance has event size {covariance.event_size} but the constraint acts on vectors of size "
                f"{constraint.event_size}."
            )
        self.cov = covariance
        self.constraint = constraint
        self.dtype = constraint.k.dtype
        self._factorise()

    @property
    def group_variance(self) -> Tensor:
        """``grouped`` only: the diagonal of :math:`S = A\\Sigma A^\top` (per-group sums of the variances)."""
        if not self.grouped:
            raise AttributeError("group_variance exists only for the grouped method.")
        if self._group_variance is None:
            self._group_variance = self.constraint.diagonal_gram(self.cov.variance)
        return self._group_variance

    # ================================================================== factorisation
    def _factorise(self, method: str | None = None) -> None:
        """All factorisation work. ``method=None``: choose (see the module docstring); otherwise force
        ``"cholesky64"`` or ``"qr"`` (used by the escalation after a failed residual check; never null-space)."""
        cov, con = self.cov, self.constraint
        self._abs_A = None
        self._col_min = None
        self._E = None
        self._W = None
        self._ns = None
        if method is None and isinstance(cov, DiagonalCovariance):
            c = _sqrt_scale(cov)
            v = (cov.scale / c).square()  # normalised variances: no under/overflow for extreme scales
            gv = con.diagonal_gram(v)
            if gv is not None:
                self.method, self.grouped = "grouped", True
                _check_pivots(gv, torch.zeros_like(gv))
                self._c, self._v, self._gv = c, v, gv
                # few groups, small a * n and a shared covariance: group sums by a GEMM with the one-hot matrix E
                # (blocked accumulation, as accurate as the two-level sum), the gain as one GEMM with W' = E diag(v')
                a, n = gv.shape[-1], v.shape[-1]
                if v.dim() == 1 and a <= _ONEHOT_MAX_GROUPS and a * n <= _CHUNK_ELEMS:
                    self._E = con.dense_matrix()
                    self._W = self._E * v
                self._group_variance = None  # diag of S, for the KL's closed form: computed when asked for
                return
        self.grouped = False
        self._v = None
        A = con.dense_matrix()
        self._A = A
        self._c = _sqrt_scale(cov)  # (*batch_cov, 1)
        wide = self.dtype in (torch.float32, torch.float16, torch.bfloat16)
        nullspace = method is None and 2 * A.shape[-2] > A.shape[-1] and not A.requires_grad
        if method is None:
            L, kappa = self._gram_cholesky(A, self.dtype)
            if L is not None and kappa <= (_KAPPA_MAX_32 if wide else _KAPPA_MAX_64):
                self._set_cholesky("cholesky", L)
                method = "done"
            else:
                method = "cholesky64" if wide else "qr"
        if method == "cholesky64":
            L, kappa = self._gram_cholesky(A, torch.float64)
            if L is not None and kappa <= _KAPPA_MAX_64:
                self._set_cholesky("cholesky64", L)
                method = "done"
            else:
                method = "qr"
        if method == "qr":
            self._set_qr(A)
        if nullspace:  # n - a < a: the samples, gain and variances through an (n - a)-dim basis of null(A)
            self._set_nullspace()

    # ---------------------------------------------------------------- Gram + Cholesky
    def _gram_cholesky(self, A: Tensor, dtype: torch.dtype) -> tuple[Tensor | None, float]:
        """Cholesky factor of ``S' = A Sigma' A^T`` formed in ``dtype`` (or None when it fails), and the
        pivot-ratio estimate of kappa(S)."""
        S = self._gram(A, dtype)
        if not bool(torch.isfinite(S).all()):
            if dtype != torch.float64:  # over/underflow of a float32 Gram: let the float64 path decide
                return None, math.inf
            raise NotPSDError(
                f"A Sigma A^T has NaN/inf entries (shape {tuple(S.shape)}, dtype {dtype}); check the inputs "
                "(loc, scales and A must be finite)."
            )
        L, info = torch.linalg.cholesky_ex(S)
        if bool((info > 0).any()):
            return None, math.inf
        d = L.diagonal(dim1=-2, dim2=-1)
        ratio = (d.amax(-1) / d.amin(-1)).amax()
        kappa = float(ratio.detach()) ** 2
        return L, (kappa if math.isfinite(kappa) else math.inf)

    def _gram(self, A: Tensor, dtype: torch.dtype) -> Tensor:
        r""":math:`S' = A\Sigma'A^\top` in ``dtype``, shape ``(*batch, a, a)``."""
        cov, c = self.cov, self._c
        A_ = A.to(dtype)
        if isinstance(cov, DiagonalCovariance):
            if dtype == self.dtype:
                v = self._normalised_variance()
            else:
                v = (cov.scale.to(dtype) / c.to(dtype)).square()  # (*bs, n)
            return _diag_gram(A_, v)
        Bt = cov.sqrt_t_matmul(A_.mT) if dtype == A.dtype else _sqrt_t_matmul_as(cov, A_.mT, dtype)
        Bt = Bt / c.to(dtype).unsqueeze(-1)
        return Bt.mT @ Bt

    def _set_cholesky(self, method: str, L: Tensor) -> None:
        self.method = self._base = method
        self._L = L  # lower, S' = L L^T, (*batch, a, a), float64 for "cholesky64"
        self._Q = None
        self._prepare_gain()

    def _set_qr(self, A: Tensor) -> None:
        dtype = torch.float64 if self.dtype != torch.float64 else self.dtype
        cov, c = self.cov, self._c
        A_ = A.to(dtype)
        Bt = cov.sqrt_t_matmul(A_.mT) if dtype == A.dtype else _sqrt_t_matmul_as(cov, A_.mT, dtype)
        Bt = Bt / c.to(dtype).unsqueeze(-1)  # (*batch, m, a)
        Q, R = torch.linalg.qr(Bt)
        pivots = R.diagonal(dim1=-2, dim2=-1).abs()
        eps = torch.finfo(dtype).eps  # the inputs are exact in float64: decide the rank at float64 precision
        _check_pivots(pivots, 10 * eps * Bt.abs().amax((-2, -1)).unsqueeze(-1))
        self.method = self._base = "qr"
        self._v = None
        self._Q = Q
        self._L = R.mT  # S' = R^T R = L L^T with L = R^T (diagonal signs do not matter)
        self._W = None

    def _set_nullspace(self) -> None:
        r"""The null-space form (``n - a < a``), on top of the factor of :math:`S` (kept for :meth:`whiten`,
        :meth:`inv_quad`, :meth:`logdet`, :meth:`gain_factor`). All in float64.

        Complete QR :math:`A^\top = [Q_A, N]\,[R; 0]` (per batch element of ``A``): ``N`` (``n x p``,
        ``p = n - a``) is an orthonormal basis of :math:`\mathrm{null}(A)`, :math:`z_p = Q_A R^{-\top}k` the
        minimum-norm solution. With :math:`M' = N^\top\Sigma'^{-1}N = L_M L_M^\top`, keeps
        :math:`V = N L_M^{-\top}` and :math:`U = \Sigma'^{-1}V` (``n x p`` each): the Matheron map is
        :math:`z = z_p + VU^\top(\hat z - z_p)` and the conditional covariance is :math:`c^2 VV^\top`. Leaves the
        base method in place when the covariance type is unknown, ``A`` is numerically rank deficient,
        :math:`M'` is not numerically positive definite, or ``V`` would exceed ``max(4 A.numel(), 2^24)``
        elements (many per-sample covariances with a shared ``A``)."""
        A, gd = self._A, torch.float64
        n, a = A.shape[-1], A.shape[-2]
        cov = _scaled_cov(self.cov, self._c)
        if cov is None:
            return
        cov = cov.to(dtype=gd)
        Q, R = torch.linalg.qr(A.to(gd).mT, mode="complete")  # (*bA, n, n), (*bA, n, a)
        QA, N, Ra = Q[..., :a], Q[..., a:], R[..., :a, :]
        pivots = Ra.diagonal(dim1=-2, dim2=-1).abs()
        if not bool((pivots > 10 * torch.finfo(gd).eps * A.abs().amax((-2, -1)).to(gd).unsqueeze(-1)).all()):
            return
        batch = torch.broadcast_shapes(A.shape[:-2], cov.batch_shape)
        if math.prod(batch) * n * (n - a) > max(4 * A.numel(), _CHUNK_ELEMS):
            return  # V and U would be much larger than the inputs (many per-sample covariances): keep the base
        Ne = N.expand(batch + N.shape[-2:])
        Y = cov.inv_matvec(Ne.movedim(-1, 0)).movedim(0, -1)  # Sigma'^-1 N, (*batch, n, p)
        M = Ne.mT @ Y
        LM, info = torch.linalg.cholesky_ex(0.5 * (M + M.mT))
        if bool((info > 0).any()):
            return
        V = torch.linalg.solve_triangular(LM, Ne.mT, upper=False).mT
        U = torch.linalg.solve_triangular(LM, Y.mT, upper=False).mT
        zp = batch_mv(QA, tri_solve_vec(Ra.mT, self.constraint.k.to(gd), upper=False))
        self._ns = (QA, Ra, V, U, zp)
        self.method = "nullspace"

    def _ns_project(self, x: Tensor) -> Tensor:
        r""":math:`VU^\top x = N M^{-1} N^\top\Sigma^{-1} x` (float64): the :math:`\Sigma^{-1}`-orthogonal
        projection of ``x`` onto :math:`\mathrm{null}(A)`."""
        V, U = self._ns[2], self._ns[3]
        if x.dim() - 1 < V.dim() - 2:  # fewer dimensions than the batch: no sample dimensions, broadcast
            x = x.expand(torch.broadcast_shapes(x.shape, V.shape[:-2] + x.shape[-1:]))
        return batch_mv(V, batch_mv(U.mT, x))

    def _normalised_variance(self) -> Tensor:
        """``(scale / c)^2``, computed once per factorisation."""
        if getattr(self, "_vn_for", None) is not self._c:
            self._vn, self._vn_for = (self.cov.scale / self._c).square(), self._c
        return self._vn

    def _prepare_gain(self) -> None:
        r"""Tensors of the gain, in the factor's dtype (float64 for ``"cholesky64"``: with a large
        :math:`\kappa(S)` the vector :math:`x = S'^{-1}r` has large entries that cancel in
        :math:`\Sigma'A^\top x`, so the product must be formed in the factor's precision too).

        Keeps :math:`W' = A\Sigma'` (``(*batch, a, n)``) when it is no larger than the inputs (shared
        covariance), so that a gain costs one GEMM; otherwise the gain is applied as ``Sigma' (A^T x)``."""
        gd = self._L.dtype
        cov = self.cov if gd == self.dtype else self.cov.to(dtype=gd)
        A = self._A.to(gd)
        c = self._c.to(gd)
        self._cov_g, self._Ag, self._W, self._v = cov, A, None, None
        if isinstance(cov, DiagonalCovariance):
            v = self._normalised_variance() if gd == self.dtype else (cov.scale / c).square()
            if cov.scale.dim() == 1:
                self._W = A * v
            else:
                self._v = v
            return
        inputs = max(A.numel(), _param_numel(cov))
        batch = torch.broadcast_shapes(A.shape[:-2], cov.batch_shape)
        if math.prod(batch) * A.shape[-2] * A.shape[-1] <= inputs:
            Bt = cov.sqrt_t_matmul(A.mT) / c.unsqueeze(-1)
            self._W = (cov.sqrt_matmul(Bt) / c.unsqueeze(-1)).mT  # A Sigma', (*batch, a, n)

    # ================================================================== S = A Sigma A^T
    def _solve_S(self, r: Tensor) -> Tensor:
        r""":math:`S'^{-1} r`, computed and returned in the factor's dtype."""
        L = self._L
        y = tri_solve_vec(L, r.to(L.dtype), upper=False)
        return tri_solve_vec(L.mT, y, upper=True)

    def whiten(self, residual: Tensor) -> Tensor:
        r""":math:`L^{-1} r` with :math:`LL^\top = S`, so that :math:`\lVert L^{-1} r\rVert^2 = r^\top S^{-1} r`."""
        if self.grouped:
            return residual / self._gv.sqrt() / self._c
        y = tri_solve_vec(self._L, residual.to(self._L.dtype), upper=False)
        return (y / self._c.to(y.dtype)).to(self.dtype)

    def inv_quad(self, residual: Tensor) -> Tensor:
        r""":math:`r^\top S^{-1} r`, shape ``(*sample, *batch)``."""
        return self.whiten(residual).square().sum(-1)

    def logdet(self) -> Tensor:
        r""":math:`\log\det S`, shape ``(*batch)`` (``2 sum log L_jj + 2 a log c``)."""
        if self.grouped:
            return self._gv.log().sum(-1) + 2 * self._gv.shape[-1] * self._c.squeeze(-1).log()
        d = self._L.diagonal(dim1=-2, dim2=-1).abs()
        a = d.shape[-1]
        out = 2 * d.log().sum(-1) + 2 * a * self._c.squeeze(-1).to(d.dtype).log()
        return out.to(self.dtype)

    # ================================================================== gain
    def _gain_from_x(self, x: Tensor) -> Tensor:
        r""":math:`\Sigma' A^\top x` (``x`` already solved with the normalised :math:`S'`; not for ``"qr"``)."""
        if self._W is not None:
            out = batch_mv(self._W.mT, x)
        else:
            At_x = batch_mv(self._Ag.mT, x)
            if self._v is not None:
                out = self._v * At_x
            else:
                out = self._cov_g.matvec(At_x) / self._c.to(At_x.dtype).square()
        return out.to(self.dtype)

    def gain_matvec(self, residual: Tensor) -> Tensor:
        r""":math:`K r = \Sigma A^\top S^{-1} r` for ``r`` of shape ``(*sample, *batch, a)``."""
        if self.grouped:
            return self._v * self.constraint.rmatvec(residual / self._gv)
        if self._ns is not None:  # K r = (I - V U^T) x_p for any A x_p = r; x_p = Q_A R^-T r
            QA, Ra = self._ns[0], self._ns[1]
            xp = batch_mv(QA, tri_solve_vec(Ra.mT, residual.to(Ra.dtype), upper=False))
            return (xp - self._ns_project(xp)).to(self.dtype)
        if self.method == "qr":  # K r = F' Q R'^{-T} r with B'^T = Q R', F' = F / c
            y = tri_solve_vec(self._L, residual.to(self._L.dtype), upper=False)
            g = batch_mv(self._Q, y).to(self.dtype)
            return self.cov.sqrt_matvec(g) / self._c
        return self._gain_from_x(self._solve_S(residual))

    def condition(self, z_hat: Tensor) -> Tensor:
        r""":math:`z = \hat z + K(k - A\hat z)`: maps :math:`\mathcal N(\mu, \Sigma)` samples to exact
        conditional samples, and :math:`\mu` to :math:`\bar\mu`. Differentiable. Samples whose residual
        fails the check get refinement steps (see the module docstring); shape ``(*sample, *batch, n)``."""
        while True:
            z = self._step(z_hat)
            for _ in range(MAX_REFINEMENT_STEPS):
                bad = self._failing(z)
                if bad is None:
                    return z
                z = torch.where(bad.unsqueeze(-1), self._refine(z), z)
            if self._failing(z) is None:
                return z
            self._escalate(z)

    def _refine(self, z: Tensor) -> Tensor:
        r"""One refinement step :math:`z + K(k - Az)`. Null-space path: in float64 with the residual of ``z``
        itself (repeating :math:`z_p + VU^\top(z - z_p)` would reproduce the rounding of :math:`z_p`)."""
        if self._ns is None:
            return self._step(z)
        A = self._A.to(torch.float64)
        z64 = z.to(torch.float64)
        r = self.constraint.k.to(torch.float64) - batch_mv(A, z64)
        xp = batch_mv(self._ns[0], tri_solve_vec(self._ns[1].mT, r, upper=False))
        return (z64 + (xp - self._ns_project(xp))).to(self.dtype)

    def _matvec(self, z: Tensor) -> Tensor:
        """``A z`` (a GEMM with the one-hot matrix for a small grouped constraint)."""
        if self._E is not None:
            return batch_mv(self._E, z)
        if not self.grouped:
            return batch_mv(self._A, z)
        return self.constraint.matvec(z)

    def _step(self, z: Tensor) -> Tensor:
        r"""One Matheron step :math:`z + K(k - Az)`, with the update fused into one kernel where the
        structure allows (``addmm`` with a shared :math:`W' = A\Sigma'`, ``addcmul`` with per-sample
        diagonal scales): one ``n``-sized output, no further temporaries of that size."""
        if self._ns is not None:  # z_p + V U^T (z - z_p): no ulp(z_hat) error, A z - k = O(eps) for any kappa
            zp = self._ns[4]
            return (zp + self._ns_project(z.to(zp.dtype) - zp)).to(self.dtype)
        r = self.constraint.k - self._matvec(z)
        if self.method == "qr":
            return z + self.gain_matvec(r)
        if self.grouped:
            x = r / self._gv
        else:
            x = self._solve_S(r)
            if x.dtype != z.dtype:  # "cholesky64": the gain in float64, rounded once
                return z + self._gain_from_x(x)
        W = self._W
        if W is not None and W.dim() == 2:
            n, a = W.shape[-1], W.shape[-2]
            shape = torch.broadcast_shapes(z.shape[:-1], x.shape[:-1])
            out = torch.addmm(z.expand(shape + (n,)).reshape(-1, n), x.expand(shape + (a,)).reshape(-1, a), W)
            return out.view(shape + (n,))
        if self.grouped:
            return torch.addcmul(z, self._v, self.constraint.rmatvec(x))
        if self._v is not None:
            return torch.addcmul(z, self._v, batch_mv(self._A.mT, x))
        return z + self._gain_from_x(x)

    @torch.no_grad()
    def sample(self, loc: Tensor, sample_shape: torch.Size | tuple = (), noise: Tensor | None = None,
               generator: torch.Generator | None = None) -> Tensor:
        r"""Exact conditional samples ``condition(loc + F eps)`` without gradient, computed in place on one
        ``(*sample, *batch, n)`` buffer (a shared diagonal covariance costs ``randn`` + two GEMMs + the
        check). ``noise`` (shape ``(*sample_shape, *batch, noise_size)``) defaults to fresh ``randn``."""
        batch = torch.broadcast_shapes(loc.shape[:-1], self.cov.batch_shape, self.constraint.batch_shape)
        n = self.cov.event_size
        if noise is None:
            shape = torch.Size(sample_shape) + batch + (self.cov.noise_size,)
            noise = torch.randn(shape, dtype=loc.dtype, device=loc.device, generator=generator)
            owned = True
        else:
            owned = False
        cov = self.cov
        if isinstance(cov, DiagonalCovariance) and owned and noise.shape[-1] == n:
            z = noise.mul_(cov.scale).add_(loc)
        else:
            z = loc + cov.sqrt_matvec(noise)
        if (self.method in ("qr", "cholesky64", "nullspace") or z.requires_grad or not z.is_contiguous()):
            return self.condition(z)
        # one in-place Matheron step on the sample buffer, then the residual check
        k, con = self.constraint.k, self.constraint
        if self.grouped and self._E is not None:
            z2 = z.view(-1, n)
            r = k - (z2 @ self._E.mT).view(z.shape[:-1] + (self._E.shape[-2],))
            z2.addmm_((r / self._gv).reshape(-1, self._E.shape[-2]), self._W)
        elif self.grouped:
            z.addcmul_(self._v, con.rmatvec((k - con.matvec(z)) / self._gv))
        elif self._W is not None and self._W.dim() == 2:  # shared gain W' (a x n): one GEMM with beta = 1
            A, W = self._A, self._W
            z2 = z.view(-1, n)
            r = (k - (z2 @ A.mT).view(z.shape[:-1] + (A.shape[-2],)))
            z2.addmm_(self._solve_S(r).reshape(-1, A.shape[-2]), W)
        elif self._v is not None and self._A.dim() == 2:  # per-sample diagonal scales, shared A
            A = self._A
            x = self._solve_S(k - z @ A.mT)
            z.addcmul_(self._v, x @ A)
        else:
            return self.condition(z)
        if self._failing(z) is None:
            return z
        return self.condition(z)

    # ---------------------------------------------------------------- residual check
    @torch.no_grad()
    def _failing(self, z: Tensor) -> Tensor | None:
        """Boolean mask ``(*sample, *batch)`` of samples whose residual exceeds the check, or None if none.

        Tolerance ``rtol * max_i (|A||z|)_i`` with ``rtol = min(eps max(4, 2 sqrt(n)), cap)`` (the
        ``sqrt(n)`` term: the residual's own evaluation error). Three tiers, cheapest first: a lower bound of
        ``max_i (|A||z|)_i`` from ``||z||_1``; the exact ``|A||z|``; for float32, the residual re-evaluated in
        float64 (so that evaluation noise never triggers a refinement that cannot help)."""
        con = self.constraint
        rtol = _check_rtol(z.dtype, z.shape[-1])
        Az = batch_mv(self._E, z) if self._E is not None else con.matvec(z)
        res = (Az - con.k).abs().amax(-1)
        if not bool(torch.isfinite(res).all()):
            raise NotPSDError(
                f"conditioning produced NaN/inf (method {self.method!r}, dtype {z.dtype}); the inputs are not "
                "finite or the scales are out of range for this dtype (try float64)."
            )
        lower = Az.abs().amax(-1)  # max_i |(Az)_i| <= max_i (|A||z|)_i
        colmin = self._column_min()
        if colmin is not None:  # max_i (|A||z|)_i >= sum_j c_j |z_j| / a >= min_j c_j ||z||_1 / a
            lower = torch.maximum(lower, torch.linalg.vector_norm(z, 1, -1) * colmin)
        if bool((res <= rtol * lower).all()):
            return None
        scale = self._abs_matvec(z).amax(-1)
        bad = ~(res <= rtol * scale)
        if not bool(bad.any()):
            return None
        if z.dtype != torch.float64:
            z64 = z.double()
            if self.grouped:
                res64 = con.to(dtype=torch.float64).residual(z64)
            else:
                res64 = batch_mv(self._A.double(), z64) - con.k.double()
            bad = ~(res64.abs().amax(-1) <= rtol * scale.double())
        return bad if bool(bad.any()) else None

    def _column_min(self) -> Tensor | None:
        """``min_j sum_i |A_ij| / a`` (a lower bound factor for ``max_i (|A||z|)_i / ||z||_1``); None if 0."""
        if self._col_min is None:
            if self.grouped:
                self._col_min = torch.tensor(1.0 / self.constraint.num_constraints, dtype=self.dtype)
            else:
                colsum = self._A.abs().sum(-2).amin(-1)  # (*batch_A)
                self._col_min = colsum / self._A.shape[-2]
        cm = self._col_min
        return None if not bool((cm > 0).all()) else (cm if cm.dim() == 0 else cm)

    def _abs_matvec(self, z: Tensor) -> Tensor:
        if self._E is not None:
            return batch_mv(self._E, z.abs())
        if self.grouped:
            return self.constraint.matvec(z.abs())
        if self._abs_A is None:
            self._abs_A = self._A.abs()
        return batch_mv(self._abs_A, z.abs())

    def _escalate(self, z: Tensor) -> None:
        if self.method == "nullspace":
            return self._factorise("qr")
        if self.grouped or self.method == "qr":
            res = self.constraint.residual(z).abs().amax()
            raise NotPSDError(
                f"the conditioned vector misses A z = k by {res.item():.3e} after {MAX_REFINEMENT_STEPS} "
                f"refinement steps (method {self.method!r}, dtype {z.dtype}); A Sigma A^T is too ill-conditioned "
                "for this dtype. Use float64, or rescale/remove nearly dependent rows of A."
            )
        self._factorise(_ORDER[_ORDER.index(self.method) + 1])

    # ================================================================== gain factor and moments
    def gain_factor(self) -> Tensor:
        r""":math:`G = \Sigma A^\top L^{-\top}` (``(*batch, n, a)``, transient), with
        :math:`GG^\top = \Sigma A^\top S^{-1} A\Sigma`."""
        if self.grouped:
            A = self.constraint.dense_matrix()  # (a, n)
            return (self.cov.variance.unsqueeze(-1) * A.mT) / self.group_variance.sqrt().unsqueeze(-2)
        if self._base == "qr":
            return self.cov.sqrt_matmul(self._Q.to(self.dtype))  # G = F Q (Q does not depend on c)
        return self._gain_rows(0, self.cov.event_size)

    def _gain_rows(self, j0: int, j1: int) -> Tensor:
        r"""Rows ``j0:j1`` of :math:`G = c\,\Sigma' A^\top L^{-\top} = c\,(L^{-1} A\Sigma')^\top` (with
        :math:`S = c^2 LL^\top`), in the factor's dtype, returned in the working dtype; shape
        ``(*batch, j1 - j0, a)``."""
        L = self._L
        cov, A, c = self._cov_g, self._Ag, self._c.to(L.dtype)
        if isinstance(cov, DiagonalCovariance):
            v = (cov.scale[..., j0:j1] / c).square()
            Wt = v.unsqueeze(-2) * A[..., j0:j1]  # (*batch, a, j)
        else:
            W = self._W if self._W is not None else (
                cov.sqrt_matmul(cov.sqrt_t_matmul(A.mT) / c.unsqueeze(-1)) / c.unsqueeze(-1)).mT
            Wt = W[..., j0:j1]
        G = torch.linalg.solve_triangular(L, Wt.to(L.dtype), upper=False).mT  # (*batch, j, a)
        return (G * c.unsqueeze(-1).to(G.dtype)).to(self.dtype)

    def variance(self) -> Tensor:
        r"""Conditional marginal variances :math:`\bar\sigma^2 = \mathrm{diag}\Sigma - \lVert G_{i,:}\rVert^2`,
        shape ``(*batch, n)``, clamped at 0; computed in chunks of coordinates (transient ``batch x chunk x a``)."""
        if self.grouped:  # sigma_i^2 - sigma_i^4 / s_g(i), in the normalised variances (no overflow)
            v = self._v
            return ((v - v.square() / self.constraint.rmatvec(self._gv)) * self._c.square()).clamp_min(0)
        if self._ns is not None:  # diag(c^2 V V^T): no cancellation
            V = self._ns[2]
            return (V.square().sum(-1) * self._c.to(V.dtype).square()).to(self.dtype)
        if self.method == "qr":
            reduction = self.gain_factor().square().sum(-1)
            return (self.cov.diagonal() - reduction).clamp_min(0)
        n, a = self.cov.event_size, self._A.shape[-2]
        batch = math.prod(torch.broadcast_shapes(self._A.shape[:-2], self.cov.batch_shape, self._L.shape[:-2]))
        step = max(1, _CHUNK_ELEMS // max(1, batch * a))
        parts = [self._gain_rows(j, min(n, j + step)).square().sum(-1) for j in range(0, n, step)]
        return (self.cov.diagonal() - torch.cat(parts, -1)).clamp_min(0)

    def covariance_matrix(self) -> Tensor:
        r"""Dense conditional covariance :math:`\Sigma - GG^\top`, ``(*batch, n, n)``."""
        if self._ns is not None:
            V = self._ns[2]
            return ((V @ V.mT) * self._c.to(V.dtype).square().unsqueeze(-1)).to(self.dtype)
        G = self.gain_factor()
        return self.cov.dense() - G @ G.mT


# ====================================================================== helpers
def _check_rtol(dtype: torch.dtype, n: int) -> float:
    eps = torch.finfo(dtype).eps
    return min(eps * max(4.0, 2.0 * math.sqrt(n)), CHECK_RTOL_CAP.get(dtype, 1e3 * eps))


def _sqrt_scale(cov: Covariance) -> Tensor:
    """Largest absolute entry of the square root ``F`` per batch element, shape ``(*batch_cov, 1)``
    (detached: the gain does not depend on it)."""
    with torch.no_grad():
        if isinstance(cov, DiagonalCovariance):  # max |scale| without an n-sized temporary
            c = torch.maximum(cov.scale.amax(-1, keepdim=True), -cov.scale.amin(-1, keepdim=True))
        elif isinstance(cov, FullCovariance):
            c = cov.scale_tril.abs().amax((-2, -1)).unsqueeze(-1)
        elif isinstance(cov, LowRankCovariance):
            c1 = cov.scale.abs().amax(-1, keepdim=True)
            c2 = cov.cov_factor.abs().amax((-2, -1)).unsqueeze(-1)
            c = torch.maximum(c1, c2)
        else:
            c = cov.diagonal().amax(-1, keepdim=True).sqrt()
        if not bool(torch.isfinite(c).all()) or not bool((c > 0).all()):
            raise NotPSDError(
                f"the covariance's scales must be finite and not all zero; got a largest entry in "
                f"[{c.min().item():.3e}, {c.max().item():.3e}]."
            )
        return c


def _scaled_cov(cov: Covariance, c: Tensor) -> Covariance | None:
    """The covariance with square root ``F / c`` (``c``: ``(*batch_cov, 1)``); None for an unknown type."""
    if isinstance(cov, DiagonalCovariance):
        return DiagonalCovariance(cov.scale / c)
    if isinstance(cov, FullCovariance):
        return FullCovariance(cov.scale_tril / c.unsqueeze(-1))
    if isinstance(cov, LowRankCovariance):
        return LowRankCovariance(cov.cov_factor / c.unsqueeze(-1), cov.scale / c)
    return None


def _param_numel(cov: Covariance) -> int:
    if isinstance(cov, FullCovariance):
        return cov.scale_tril.numel()
    if isinstance(cov, LowRankCovariance):
        return cov.cov_factor.numel() + cov.scale.numel()
    return cov.event_size


def _sqrt_t_matmul_as(cov: Covariance, Y: Tensor, dtype: torch.dtype) -> Tensor:
    """``F^T Y`` with ``F`` cast to ``dtype`` (for the float64 paths of a float32 covariance)."""
    if isinstance(cov, FullCovariance):
        return cov.scale_tril.to(dtype).mT @ Y
    if isinstance(cov, LowRankCovariance):
        return LowRankCovariance(cov.cov_factor.to(dtype), cov.scale.to(dtype)).sqrt_t_matmul(Y)
    if isinstance(cov, DiagonalCovariance):
        return cov.scale.to(dtype).unsqueeze(-1) * Y
    raise TypeError(f"unsupported covariance {type(cov).__name__}")


def _diag_gram(A: Tensor, v: Tensor) -> Tensor:
    r""":math:`A\,\mathrm{diag}(v)A^\top` for ``A`` ``(*ba, a, n)`` and ``v`` ``(*bv, n)``: one GEMM.

    Shared ``A`` (2-D) with batched ``v``: ``v @ P`` with ``P[j, (i, l)] = A_ij A_lj`` (``i <= l``) when
    ``n a(a+1)/2`` is small, else batched GEMMs ``(A v_b) A^T`` over chunks of the batch (transient
    ``chunk x a x n``)."""
    a, n = A.shape[-2:]
    if v.dim() == 1 or A.dim() > 2:
        AV = A * v.unsqueeze(-2)
        return AV @ A.mT
    bshape = v.shape[:-1]
    vf = v.reshape(-1, n)
    iu = torch.triu_indices(a, a, device=A.device)
    if n * iu.shape[1] <= _PRODUCT_ELEMS:
        P = A[iu[0]] * A[iu[1]]  # (a(a+1)/2, n)
        flat = vf @ P.mT  # (B, a(a+1)/2)
        S = flat.new_zeros(vf.shape[0], a, a)
        S[:, iu[0], iu[1]] = flat
        S[:, iu[1], iu[0]] = flat
        return S.reshape(bshape + (a, a))
    step = max(1, _CHUNK_ELEMS // (a * n))
    parts = [(A * vf[b:b + step].unsqueeze(-2)) @ A.mT for b in range(0, vf.shape[0], step)]
    return torch.cat(parts, 0).reshape(bshape + (a, a))


def _check_pivots(pivots: Tensor, tol: Tensor) -> None:
    """Raise NotPSDError when ``S`` is numerically singular: a pivot at or below ``tol`` (or NaN)."""
    bad = ~(pivots > tol)
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise NotPSDError(
            "A Sigma A^T is not numerically positive definite: the constraint rows are (nearly) linearly "
            f"dependent under this covariance (batch/row index {first}, pivot {pivots[first].item():.3e} "
            f"<= tolerance {torch.broadcast_to(tol, pivots.shape)[first].item():.3e}, dtype {pivots.dtype}). "
            "Remove redundant rows, rescale them, or use float64."
        )
