"""Core v4 review: regressions found by an adversarial check of the merged core (each against an independent
reference built from raw tensors)."""

from __future__ import annotations

import pytest
import torch

from hardeq import (
    BlockDiagonalCovariance,
    ConstrainedNormal,
    DiagonalCovariance,
    FullCovariance,
    LinearConstraint,
    LowRankCovariance,
    SparseConstraint,
    SumConstraint,
)

DTYPES = [torch.float32, torch.float64]
COVS = ["diagonal", "full", "lowrank", "block"]
CONSTRAINTS = ["sum", "linear", "coo", "csr"]
INDEX = torch.tensor([0, 1, 1, 1, 1, 1, 2, 2])  # group 0 has one member: coordinate 0 is determined


def _covariance(kind: str, scale: torch.Tensor, g: torch.Generator):
    n, dtype = scale.shape[-1], scale.dtype
    if kind == "diagonal":
        return DiagonalCovariance(scale)
    if kind == "full":
        M = torch.randn(scale.shape + (n,), generator=g, dtype=torch.float64) * 0.3
        S = M @ M.mT / n + torch.diag_embed(scale.double().square())
        return FullCovariance(torch.linalg.cholesky(S).to(dtype))
    W = torch.randn(scale.shape + (2,), generator=g, dtype=torch.float64).to(dtype)
    if kind == "lowrank":
        return LowRankCovariance(W, scale)
    return BlockDiagonalCovariance(INDEX, W, scale)


def _constraint(kind: str, k: torch.Tensor, dtype: torch.dtype):
    """Rows: coordinate 0 alone (entry -2.5 unless a sum), coordinates 1-5, coordinates 6-7."""
    if kind == "sum":
        return SumConstraint(INDEX, k.to(dtype)), 1.0
    A = torch.zeros(3, 8, dtype=torch.float64)
    A[0, 0] = -2.5
    A[1, 1:6] = torch.tensor([1.0, 2.0, -1.0, 0.5, 1.0])
    A[2, 6:] = 1.0
    A = A.to(dtype)
    if kind == "linear":
        return LinearConstraint(A, k.to(dtype)), -2.5
    sparse = A.to_sparse() if kind == "coo" else A.to_sparse_csr()
    return SparseConstraint(sparse, k.to(dtype)), -2.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cov", COVS)
@pytest.mark.parametrize("con", CONSTRAINTS)
def test_determined_coordinate_has_zero_variance_and_covariance(dtype, cov, con):
    """A determined coordinate (a row with one nonzero) has conditional variance exactly 0, and its row and column
    of ``covariance_matrix`` are exactly 0, under every structure: the factors' formulas leave round-off there
    (3.6e-7 in float32, whose square root, the stddev, is 6e-4), which was returned as is. Also: the other
    variances match a dense float64 oracle, and ``expected_l1`` at the determined coordinate is ``|mean - y|``."""
    for trial in range(6):
        g = torch.Generator().manual_seed(4242 + trial)
        scale = torch.exp(torch.randn(2, 8, generator=g, dtype=torch.float64) * 1.5).to(dtype)
        k = torch.tensor([[0.0, 3.0, -1.0], [0.7, 1.0, 2.0]], dtype=torch.float64)
        covariance = _covariance(cov, scale, g)
        constraint, coef = _constraint(con, k, dtype)
        loc = (torch.randn(2, 8, generator=g, dtype=torch.float64) * 3).to(dtype)
        d = ConstrainedNormal(loc, covariance=covariance, constraint=constraint)
        assert torch.equal(d.variance[..., 0], torch.zeros(2, dtype=dtype))
        assert torch.equal(d.stddev[..., 0], torch.zeros(2, dtype=dtype))
        cm = d.covariance_matrix
        assert torch.equal(cm[..., 0, :], torch.zeros(2, 8, dtype=dtype))
        assert torch.equal(cm[..., :, 0], torch.zeros(2, 8, dtype=dtype))
        # dense float64 oracle from raw tensors
        S = covariance.to(dtype=torch.float64).dense()
        A = constraint.to(dtype=torch.float64).dense_matrix().expand(2, 3, 8)
        gain = S @ A.mT @ torch.linalg.inv(A @ S @ A.mT)
        oracle = S - gain @ A @ S
        tol = 2e-4 if dtype == torch.float32 else 1e-10
        big = oracle.diagonal(dim1=-2, dim2=-1).abs().amax(-1, keepdim=True)
        assert ((d.variance.double() - oracle.diagonal(dim1=-2, dim2=-1)).abs() <= tol * big).all()
        y = torch.randn(2, 8, generator=g, dtype=torch.float64).to(dtype)
        want = (k[:, 0] / coef).to(dtype)
        assert torch.equal(d.mean[..., 0], want)
        assert torch.allclose(d.expected_l1(y)[..., 0], (want - y[..., 0]).abs())


def test_determined_coordinate_gradients_finite():
    """The zero variance at a determined coordinate gives finite gradients through ``stddev`` and the expected
    losses (the masked entries' gradient is dropped, not ``inf * 0``)."""
    for dtype in DTYPES:
        loc = torch.randn(6, dtype=dtype, requires_grad=True)
        scale = (torch.rand(6, dtype=dtype) + 0.5).requires_grad_()
        A = torch.tensor([[2.0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0]], dtype=dtype)
        d = ConstrainedNormal(loc, covariance=LowRankCovariance(torch.randn(6, 2, dtype=dtype), scale),
                              constraint=LinearConstraint(A, torch.tensor([0.0, 1.0], dtype=dtype)))
        y = torch.randn(6, dtype=dtype)
        (d.expected_l1(y).sum() + d.expected_l2(y).sum() + d.stddev.sum()).backward()
        assert torch.isfinite(loc.grad).all() and torch.isfinite(scale.grad).all()
        assert d.variance[0] == 0


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_constraint_without_rows_is_a_clear_error(layout):
    """A ``SparseConstraint`` with zero rows gave ``RuntimeError: min()`` from its rank check; it now reaches the
    conditioner's ``ValueError`` (as a ``LinearConstraint`` does), which points to the unconstrained law."""
    A = torch.zeros(0, 5)
    A = A.to_sparse() if layout == "coo" else A.to_sparse_csr()
    constraint = SparseConstraint(A, torch.zeros(0))
    with pytest.raises(ValueError, match="at least one row"):
        ConstrainedNormal(torch.zeros(5), torch.ones(5), constraint=constraint).sample()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["lowrank", "block"])
def test_rank_zero_factor_is_the_diagonal_law(dtype, kind):
    """A low-rank / block-diagonal covariance with a rank-0 factor (``W`` of shape ``(n, 0)``) is the diagonal law;
    the conditioner's normalising scale took ``amax`` over the empty factor (``IndexError``)."""
    g = torch.Generator().manual_seed(97)
    n = 7
    scale = (torch.rand(2, n, generator=g, dtype=torch.float64) + 0.4).to(dtype)
    W = torch.zeros(2, n, 0, dtype=dtype)
    index = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    covariance = LowRankCovariance(W, scale) if kind == "lowrank" else BlockDiagonalCovariance(index, W, scale)
    A = torch.randn(2, n, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, generator=g, dtype=torch.float64).to(dtype)
    loc = torch.randn(2, n, generator=g, dtype=torch.float64).to(dtype)
    d = ConstrainedNormal(loc, covariance=covariance, constraint=LinearConstraint(A, k))
    ref = ConstrainedNormal(loc, scale, constraint=LinearConstraint(A, k))
    z = ref.sample((3,))
    assert d.sample((3,)).shape == (3, 2, n)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d.log_prob(z), ref.log_prob(z), **tol)
    torch.testing.assert_close(d.entropy(), ref.entropy(), **tol)
    torch.testing.assert_close(d.variance, ref.variance, **tol)


def test_error_messages_name_argument_expected_and_received():
    """Messages that named the wrong argument, listed a hard-coded subset of types, or came from torch unchecked."""
    A = torch.randn(2, 5)
    c = LinearConstraint(A, torch.zeros(2))
    # a BlockDiagonalCovariance's groups are checked against num_groups (the message said total.shape[-1])
    with pytest.raises(ValueError, match=r"a = num_groups = 2, got range \[0, 2\]"):
        BlockDiagonalCovariance(torch.tensor([0, 0, 1, 1, 2]), torch.ones(5, 1), torch.ones(5), num_groups=2)
    # no hard-coded list of covariance types (it omitted BlockDiagonalCovariance)
    with pytest.raises(TypeError, match=r"covariance must be a hardeq\.Covariance .*got Tensor"):
        ConstrainedNormal(torch.zeros(5), covariance=torch.eye(5), constraint=c)
    # scale: a non-number, non-tensor says that a number is accepted too
    for bad, name in ((True, "bool"), (1j, "complex"), ([1.0], "list")):
        with pytest.raises(TypeError, match=rf"scale must be a torch.Tensor, got {name} \(a real Python number"):
            ConstrainedNormal(torch.zeros(5), bad, constraint=c)
    # the user-facing point methods of a constraint check the event size (torch's matmul error before)
    for con in (c, SumConstraint(torch.tensor([0, 0, 1, 1, 1]), torch.zeros(2)),
                SparseConstraint(A.to_sparse_csr(), torch.zeros(2))):
        for method in (con.project, con.check, con.residual):
            with pytest.raises(ValueError, match=r"z must have shape \(\.\.\., n\) with n = 5 .*got \(4,\)"):
                method(torch.ones(4))
        with pytest.raises(TypeError, match="z must be a floating-point tensor"):
            con.check(torch.ones(5, dtype=torch.long))


def test_image_shaped_value_hints_at_flattening():
    """``log_prob`` / ``expected_l1`` of image-shaped input name the trailing dimensions to flatten."""
    n = 2 * 3 * 3
    c = SumConstraint(torch.arange(n) // 9, torch.zeros(2))
    d = ConstrainedNormal(torch.zeros(4, n), 1.0, constraint=c)
    with pytest.raises(ValueError, match=r"trailing dimensions 2 x 3 x 3 hold n = 18 .*value\.flatten\(-3\)"):
        d.log_prob(torch.zeros(4, 2, 3, 3))
    with pytest.raises(ValueError, match=r"target\.flatten\(-3\)"):
        d.expected_l1(torch.zeros(4, 2, 3, 3))
    with pytest.raises(ValueError, match=r"got \(4, 17\)\.$"):  # no misleading hint when nothing flattens to n
        d.log_prob(torch.zeros(4, 17))


@pytest.mark.parametrize("cov", ["diagonal", "lowrank", "full"])
def test_float32_variance_with_wide_scales_matches_float64_oracle(cov):
    r"""float32 ``variance`` / ``covariance_matrix`` is :math:`\Sigma_{ii} - \lVert G_{i,:}\rVert^2` with ``G`` from
    the float32 Cholesky factor, whose :math:`\varepsilon_{32}\kappa` error made variances up to 1.3e-3
    :math:`\Sigma_{ii}` wrong at scales over ten decades (4.7e-5 at ratios of 300); a float32 factor with a large
    :math:`\kappa` estimate now takes them from its float64 twin. Oracle: dense float64 from the float32 inputs."""
    worst = 0.0
    for trial in range(40):
        g = torch.Generator().manual_seed(31337 + trial)
        n, a = 10, 1 + trial % 6
        A = torch.randn(a, n, generator=g, dtype=torch.float64).float()
        s = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 4).float()
        W = (torch.randn(n, 2, generator=g, dtype=torch.float64) * s.double().unsqueeze(-1)).float()
        if cov == "diagonal":
            covariance = DiagonalCovariance(s)
        elif cov == "lowrank":
            covariance = LowRankCovariance(W, s)
        else:
            W64 = W.double()
            covariance = FullCovariance(torch.linalg.cholesky(W64 @ W64.mT + torch.diag(s.double().square())).float())
        d = ConstrainedNormal(torch.zeros(n), covariance=covariance, constraint=LinearConstraint(A, torch.ones(a)))
        S = covariance.to(dtype=torch.float64).dense()
        A64 = A.double()
        oracle = S - S @ A64.mT @ torch.linalg.solve(A64 @ S @ A64.mT, A64 @ S)
        diag = S.diagonal()
        worst = max(worst, ((d.variance.double() - oracle.diagonal()).abs() / diag).max().item())
        err = (d.covariance_matrix.double() - oracle).abs() / (diag.unsqueeze(-1) * diag.unsqueeze(-2)).sqrt()
        worst = max(worst, err.max().item())
    assert worst <= 1e-5, worst


def _factor_unit_roundoff(d: ConstrainedNormal) -> float:
    """Unit roundoff of the factorisation of ``S`` that ``d`` uses, whichever path round-off chose: float64 for
    ``cholesky64`` / ``qr`` (or a float64 distribution), else float32 (the float32 Cholesky, possibly with its
    float64 twin for the moments: the float32 roundoff bounds both)."""
    factor = d.conditioner.factor
    base = getattr(factor, "base", factor)  # the null-space form wraps a factor of S
    if d.loc.dtype == torch.float64 or base.name in ("cholesky64", "qr"):
        return 2.0 ** -53
    return 2.0 ** -24


def kl_error_bound(q: ConstrainedNormal, p: ConstrainedNormal) -> float | None:
    r"""First-order bound on :math:`|\mathrm{fl}(\mathrm{KL}(q\Vert p)) - \mathrm{KL}(q\Vert p)|` for diagonal
    covariances on one dense ``A`` (docs/api.md, "Accuracy of the KL divergence"); ``None`` where the bound does not
    apply (:math:`\eta = \kappa(\tilde S)\,a(n + a + 1)u_f > 1/2`, a factor too ill-conditioned for its precision).

    ``KL = (T - C + Q - (n - a) + L_{\Sigma_p} - L_{S_p} - L_{\Sigma_q} + L_{S_q}) / 2``. The factor of the
    equilibrated Gram matrix :math:`\tilde S` (unit diagonal) is that of :math:`\tilde S + E` with
    :math:`\lVert E\rVert_2 \le a(\gamma_n + \gamma_{a+1}) \approx a(n + a + 1)u_f` (forming it:
    :math:`\gamma_n|A|\Sigma|A|^\top`, entries at most 1 after equilibration; Cholesky: :math:`\gamma_{a+1}|L||L^\top|`,
    entries at most 1), so :math:`\lVert\tilde S^{-1/2}E\tilde S^{-1/2}\rVert \le \eta` and, to first order
    (factor 2 for :math:`\eta \le 1/2`): :math:`|\Delta C| \le 2\eta C`, :math:`|\Delta L_S| \le 2a\eta`, the
    conditional mean off by at most :math:`2\eta R + \sqrt{a\kappa}(n + 2)u(\lVert\mu/\sigma\rVert +
    \lVert D^{-1}k\rVert) + 2u\lVert\bar\mu/\sigma\rVert` in the :math:`\Sigma^{-1}` norm (:math:`R^2 = r^\top S^{-1}r`,
    ``r = k - A mu``). The sums in float32 add :math:`(m + 2)u` times the sum of the absolute values of their terms."""
    u = torch.finfo(q.loc.dtype).eps / 2
    A, k = q.constraint.A.double(), q.constraint.k.double()
    a, n = A.shape
    parts = {}
    for name, d in (("q", q), ("p", p)):
        s = d.covariance.scale.double()
        S = (A * s.square()) @ A.T
        dS = S.diagonal().sqrt()
        S_eq = S / (dS[:, None] * dS[None, :])
        ev = torch.linalg.eigvalsh(S_eq)
        kappa = (ev[-1] / ev[0]).item()
        eta = kappa * a * (n + a + 1) * _factor_unit_roundoff(d)
        if eta > 0.5:
            return None
        mu = d.loc.double()
        r = k - A @ mu
        R = (r @ torch.linalg.solve(S, r)).sqrt().item()
        mean = mu + (s.square()[:, None] * A.T) @ torch.linalg.solve(S, r)
        logs = s.square().log()
        parts[name] = dict(
            s=s, eta=eta, mean=mean, Ls=logs.sum().item(), Ls_abs=logs.abs().sum().item(), LS=torch.logdet(S).item(),
            LS_abs=(S.diagonal().log().abs().sum() + a * s.square().max().log().abs()
                    + torch.logdet(S_eq).abs()).item(),
            dmean=(2 * eta * R + (a * kappa) ** 0.5 * (n + 2) * u * ((mu / s).norm() + (k / dS).norm()).item()
                   + 2 * u * (mean / s).norm().item()))
    pq, pp = parts["q"], parts["p"]
    sq, sp = pq["s"], pp["s"]
    T = (sq / sp).square().sum().item()
    Sq = (A * sq.square()) @ A.T
    C = torch.trace(torch.linalg.solve(Sq, (A * (sq.pow(4) / sp.square())) @ A.T)).item()
    Q = ((pq["mean"] - pp["mean"]) / sp).square().sum().item()
    delta = (sq / sp).max().item() * pq["dmean"] + pp["dmean"]
    terms = (T, C, Q, n - a, pp["Ls"], pp["LS"], pq["Ls"], pq["LS"])
    err = ((n + 2) * u * T + (2 * pq["eta"] + (n * a + 2) * u) * C
           + 2 * Q ** 0.5 * delta + delta ** 2 + (n + 2) * u * Q
           + sum(2 * a * x["eta"] + (2 * a + 3) * u * x["LS_abs"] + (n + 2) * u * x["Ls_abs"] for x in (pq, pp))
           + 7 * u * sum(abs(t) for t in terms))
    return 0.5 * err


def test_float32_kl_with_wide_scales_within_its_error_bound():
    """docs/api.md: the KL's error is bounded in terms of the unit roundoff and kappa of the equilibrated Gram
    matrices (:func:`kl_error_bound`), whichever factorisation round-off chose. Scales ``exp(4 randn)`` put kappa
    anywhere from 1 to 1e12, so the bound ranges from about 1e-4 nats to O(1). The float64 reference is computed
    from the same float32-rounded inputs (so only arithmetic differs), and its own bound is added."""
    from torch.distributions import kl_divergence

    checked = 0
    for trial in range(100):
        g = torch.Generator().manual_seed(55000 + trial)
        n, a = 10, 1 + trial % 6
        A = torch.randn(a, n, generator=g, dtype=torch.float64).float()
        s1 = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 4).float()
        s2 = (s1.double() * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 0.3)).float()
        m1 = (torch.randn(n, generator=g, dtype=torch.float64) * s1).float()
        m2 = (torch.randn(n, generator=g, dtype=torch.float64) * s1).float()
        out = {}
        for dtype in DTYPES:
            c = LinearConstraint(A.to(dtype), torch.ones(a, dtype=dtype))
            d1 = ConstrainedNormal(m1.to(dtype), s1.to(dtype), constraint=c)
            d2 = ConstrainedNormal(m2.to(dtype), s2.to(dtype), constraint=c)
            out[dtype] = (kl_divergence(d1, d2).item(), kl_divergence(d1, d1).item(),
                          kl_error_bound(d1, d2), kl_error_bound(d1, d1))
        (kl32, self32, bound32, self_bound), (kl64, _, bound64, _) = out[torch.float32], out[torch.float64]
        if bound32 is None or bound64 is None or self_bound is None:
            continue  # kappa too large for the factor's precision: no first-order bound (use float64 there)
        checked += 1
        assert abs(self32) <= self_bound, (trial, self32, self_bound)
        assert abs(kl32 - kl64) <= bound32 + bound64, (trial, kl32, kl64, bound32 + bound64)
    # 65 of the trials have eta <= 1/2 even in float32, so they are checked whichever path round-off picks
    assert checked >= 60, checked
