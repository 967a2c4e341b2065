"""BlockDiagonalCovariance: the shipped conformance suite (float32 and float64 against a dense float64 oracle), and the
structure end to end in a ConstrainedNormal on a PyG-like batch (one low-rank + diagonal block per graph), against
the dense null-space oracle: moments, Monte Carlo mean / covariance of samples, log_prob, entropy, KL, the expected
losses and the pathwise gradient. A SumConstraint over the same (or coarser) groups keeps the O(n) grouped path.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import hardeq
from hardeq.testing import CovarianceTestCase, dense_conditional, mc_atol

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _dense(index: torch.Tensor, W: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Sigma_ij = [h(i) = h(j)] W_i . W_j + [i = j] sigma_i^2, in float64, from the definition."""
    W, scale = W.double(), scale.double()
    same = (index.unsqueeze(-1) == index.unsqueeze(-2)).double()
    return same * (W @ W.mT) + torch.diag_embed(scale ** 2)


class TestBlockDiagonalCovariance(CovarianceTestCase):
    index = torch.tensor([0, 0, 1, 1, 1])

    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        W = (0.7 * torch.randn(batch_shape + (5, 2), dtype=torch.float64, generator=g)).to(dtype)
        scale = (0.5 + torch.rand(batch_shape + (5,), dtype=torch.float64, generator=g)).to(dtype)
        return hardeq.BlockDiagonalCovariance(self.index, W, scale), _dense(self.index, W, scale)


class TestBlockDiagonalCovarianceUnsortedGroups(CovarianceTestCase):
    """Groups need not be contiguous; one group of one."""

    index = torch.tensor([1, 0, 2, 0, 1])

    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed + 100)
        W = (0.7 * torch.randn(batch_shape + (5, 3), dtype=torch.float64, generator=g)).to(dtype)
        scale = (0.5 + torch.rand(batch_shape + (5,), dtype=torch.float64, generator=g)).to(dtype)
        return hardeq.BlockDiagonalCovariance(self.index, W, scale), _dense(self.index, W, scale)


# ---------------------------------------------------------------------------------------- end to end
SIZES = (4, 2, 5)  # three graphs
BATCH = (2,)


def _problem(dtype, *, constraint_index=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    n = index.numel()
    W = 0.8 * torch.randn(BATCH + (n, 2), dtype=torch.float64, generator=g)
    scale = 0.4 + torch.rand(BATCH + (n,), dtype=torch.float64, generator=g)
    loc = torch.randn(BATCH + (n,), dtype=torch.float64, generator=g)
    cidx = index if constraint_index is None else constraint_index
    a = int(cidx.max()) + 1
    k = torch.randn(BATCH + (a,), dtype=torch.float64, generator=g) * 2
    cov = hardeq.BlockDiagonalCovariance(index, W.to(dtype), scale.to(dtype))
    con = hardeq.SumConstraint(cidx, k.to(dtype))
    d = hardeq.ConstrainedNormal(loc.to(dtype), covariance=cov, constraint=con)
    A = con.dense_matrix().double()
    oracles = [dense_conditional(loc[b], _dense(index, W[b], scale[b]), A, k[b]) for b in range(BATCH[0])]
    return d, oracles, (index, W, scale, loc, k, A)


def _close(actual, expected, dtype, what):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _folded_mean(m, v):
    sd = v.clamp_min(0).sqrt()
    return sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * (m / sd) ** 2) + m * torch.erf(m / (sd * math.sqrt(2)))


class TestBlockDiagonalEndToEnd:
    @DTYPES
    @pytest.mark.parametrize("layout", ["same_groups", "one_sum", "straddling"])
    def test_moments_density_entropy_kl_and_losses(self, dtype, layout):
        cidx = {"same_groups": None, "one_sum": torch.zeros(sum(SIZES), dtype=torch.long),
                "straddling": torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])}[layout]
        d, oracles, (index, W, scale, loc, k, A) = _problem(dtype, constraint_index=cidx)
        expected_method = "grouped" if layout != "straddling" else None
        if expected_method:
            assert d.conditioner.method == "grouped", "a SumConstraint over whole covariance groups: the O(n) path"
        else:
            assert d.conditioner.method != "grouped", "a covariance group straddles two constraint groups"
        y = torch.linspace(-1.0, 1.5, sum(SIZES), dtype=torch.float64)
        kl_self = torch.distributions.kl_divergence(d, d)
        assert bool((kl_self.abs() < (1e-4 if dtype == torch.float32 else 1e-11)).all()), kl_self
        # a second distribution on the same plane: another block-diagonal covariance, and a diagonal one
        g = torch.Generator().manual_seed(7)
        W2 = 0.5 * torch.randn(BATCH + (sum(SIZES), 2), dtype=torch.float64, generator=g)
        s2 = 0.6 + torch.rand(BATCH + (sum(SIZES),), dtype=torch.float64, generator=g)
        loc2 = loc.flip(-1)
        p_block = hardeq.ConstrainedNormal(loc2.to(dtype), constraint=d.constraint,
                                           covariance=hardeq.BlockDiagonalCovariance(index, W2.to(dtype), s2.to(dtype)))
        p_diag = hardeq.ConstrainedNormal(loc2.to(dtype), s2.to(dtype), constraint=d.constraint)
        zs = torch.stack([o.mean + o.basis @ torch.linspace(-1.0, 1.0, o.basis.shape[-1], dtype=torch.float64)
                          for o in oracles])  # a point on each batch element's plane
        log_prob = d.log_prob(zs.to(dtype))
        for b, o in enumerate(oracles):
            var = o.covariance.diagonal()
            _close(d.mean[b], o.mean, dtype, "mean")
            _close(d.variance[b], var, dtype, "variance")
            _close(d.covariance_matrix[b], o.covariance, dtype, "covariance_matrix")
            _close(d.entropy()[b], o.entropy(), dtype, "entropy")
            _close(log_prob[b], o.log_prob(zs[b]), dtype, "log_prob")
            _close(d.expected_l2(y.to(dtype))[b], (o.mean - y) ** 2 + var, dtype, "expected_l2")
            _close(d.expected_l1(y.to(dtype))[b], _folded_mean(o.mean - y, var), dtype, "expected_l1")
            o_block = dense_conditional(loc2[b], _dense(index, W2[b], s2[b]), A, k[b])
            o_diag = dense_conditional(loc2[b], torch.diag(s2[b] ** 2), A, k[b])
            kl = torch.distributions.kl_divergence
            _close(kl(d, p_block)[b], kl(o.t_distribution, o_block.t_distribution), dtype, "KL(d, block)")
            _close(kl(p_block, d)[b], kl(o_block.t_distribution, o.t_distribution), dtype, "KL(block, d)")
            _close(kl(d, p_diag)[b], kl(o.t_distribution, o_diag.t_distribution), dtype, "KL(d, diagonal)")

    @DTYPES
    def test_samples_monte_carlo_mean_and_covariance(self, dtype):
        d, oracles, _ = _problem(dtype)
        torch.manual_seed(1)
        N = 20_000
        z = d.sample((N,)).double()
        assert bool(d.constraint.check(z.to(dtype)).all())
        for b, o in enumerate(oracles):
            C = o.covariance
            sd = C.diagonal().clamp_min(0).sqrt()
            mean_err = (z[:, b].mean(0) - o.mean).abs()
            assert bool((mean_err <= mc_atol(sd, N) + 1e-5).all()), (mean_err, sd)
            # entries of the sample covariance: sd of x_i x_j products is at most sd_i sd_j sqrt(1 + rho^2) <= sqrt 2
            emp = torch.cov(z[:, b].T)
            band = mc_atol(math.sqrt(2) * sd.unsqueeze(-1) * sd.unsqueeze(-2), N) + 1e-5
            assert bool(((emp - C).abs() <= band).all()), ((emp - C).abs() - band).max()

    @DTYPES
    def test_pathwise_gradient_matches_the_dense_matheron_map(self, dtype):
        """With the same noise, the library's rsample and the dense float64 Matheron map give the same sample and
        the same gradient w.r.t. loc, cov_factor and scale."""
        d, _, (index, W, scale, loc, k, A) = _problem(dtype)
        n, G, r = sum(SIZES), len(SIZES), 2
        gen = torch.Generator().manual_seed(3)
        noise = torch.randn((3,) + BATCH + (n + G * r,), dtype=torch.float64, generator=gen)
        y = torch.linspace(0.5, -0.5, n, dtype=torch.float64)

        def loss_lib(loc_, W_, s_):
            cov = hardeq.BlockDiagonalCovariance(index, W_, s_)
            dist = hardeq.ConstrainedNormal(loc_, covariance=cov, constraint=d.constraint)
            return (dist.rsample((3,), noise=noise.to(dtype)) - y.to(dtype)).square().sum()

        def loss_dense(loc_, W_, s_):
            blocks = (torch.nn.functional.one_hot(index, G).double().unsqueeze(-1) * W_.unsqueeze(-2)).flatten(-2)
            F = torch.cat([torch.diag_embed(s_), blocks], -1)  # (*B, n, n + G r)
            S = F @ F.mT
            x = loc_ + (F @ noise.unsqueeze(-1)).squeeze(-1)
            gain = S @ A.T @ torch.linalg.inv(A @ S @ A.T)
            z = x + ((k - x @ A.T).unsqueeze(-2) @ gain.mT).squeeze(-2)
            return (z - y).square().sum()

        params = [t.to(dtype).requires_grad_() for t in (loc, W, scale)]
        grads = torch.autograd.grad(loss_lib(*params), params)
        ref_params = [t.clone().requires_grad_() for t in (loc, W, scale)]
        ref = torch.autograd.grad(loss_dense(*ref_params), ref_params)
        tol = TOL[dtype] if dtype == torch.float64 else dict(rtol=1e-3, atol=1e-3)
        for got, want, name in zip(grads, ref, ("loc", "cov_factor", "scale")):
            torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, name=name: f"d/d{name}: {m}")

    def test_pathwise_gradient_is_unbiased_for_the_expected_l2(self):
        """The Monte Carlo mean of pathwise gradients of |z - y|^2 equals the gradient of expected_l2(y).sum()
        (40 batches of 500 draws; 5-sigma band from the spread of the batch means)."""
        d, _, (index, W, scale, loc, k, A) = _problem(torch.float64)
        y = torch.linspace(0.5, -0.5, sum(SIZES), dtype=torch.float64)
        params = [t.clone().requires_grad_() for t in (W, scale)]

        def dist():
            return hardeq.ConstrainedNormal(loc, covariance=hardeq.BlockDiagonalCovariance(index, *params),
                                            constraint=d.constraint)

        exact = torch.autograd.grad(dist().expected_l2(y).sum(), params)
        torch.manual_seed(5)
        per_batch = [torch.autograd.grad((dist().rsample((500,)) - y).square().sum() / 500, params)
                     for _ in range(40)]
        for i, name in enumerate(("cov_factor", "scale")):
            g = torch.stack([pb[i] for pb in per_batch])
            band = 5 * g.std(0) / math.sqrt(40) + 1e-8
            assert bool(((g.mean(0) - exact[i]).abs() <= band).all()), name


class _LargestTensor(TorchFunctionMode):
    """Records the largest tensor any torch function returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_forms_n_by_n():
    """3,000 nodes in 300 graphs: sample, log_prob, entropy, variance, KL and a gradient, with no tensor anywhere
    near n^2 = 9e6 entries (the largest is O(n r + G r^2))."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(5, 16, (300,), generator=g)
    index = torch.repeat_interleave(torch.arange(300), sizes)
    n = index.numel()
    W = (0.5 * torch.randn(n, 3, dtype=torch.float64, generator=g)).requires_grad_()
    scale = 0.5 + torch.rand(n, dtype=torch.float64, generator=g)
    con = hardeq.SumConstraint(index, torch.randn(300, dtype=torch.float64, generator=g))
    with _LargestTensor() as mode:
        d = hardeq.ConstrainedNormal(torch.zeros(n, dtype=torch.float64), constraint=con,
                                     covariance=hardeq.BlockDiagonalCovariance(index, W, scale))
        z = d.rsample((4,))
        loss = d.log_prob(z.detach()).sum() + d.entropy() + d.variance.sum() + z.square().sum()
        loss = loss + torch.distributions.kl_divergence(d, d)
        loss.backward()
    assert d.conditioner.method == "grouped"
    assert W.grad is not None and bool(torch.isfinite(W.grad).all())
    assert mode.largest <= 64 * n, f"a tensor of {mode.largest} entries (n = {n}, n^2 = {n * n})"


@pytest.mark.parametrize("edit", ["in place", "through .data"])
def test_an_edited_index_is_laid_out_again(edit):
    """The layout of an index tensor is remembered while the tensor lives unchanged; an edit (which bumps its
    version, or through ``.data``, which a content comparison sees on a CPU) gives the new groups, and a
    constraint whose groups no longer contain the covariance's takes the general path (same law as dense)."""
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    factor, scale = torch.ones(6, 1, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    for _ in range(3):  # (laid out at the first two uses, then remembered)
        cov = hardeq.BlockDiagonalCovariance(index, factor, scale)
    assert cov.counts.tolist() == [2, 2, 2]
    target = index if edit == "in place" else index.data
    target[2] = 0
    cov = hardeq.BlockDiagonalCovariance(index, factor, scale)
    assert cov.counts.tolist() == [3, 1, 2]
    expected = torch.ones(6, 6, dtype=torch.float64) * (index[:, None] == index[None, :]) + torch.eye(6)
    torch.testing.assert_close(cov.dense(), expected)
    total = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1, 1, 1]), torch.tensor([1.0, 2.0], dtype=torch.float64))
    d = hardeq.ConstrainedNormal(torch.zeros(6, dtype=torch.float64), covariance=cov, constraint=total)
    reference = hardeq.ConstrainedNormal(torch.zeros(6, dtype=torch.float64), scale_tril=torch.linalg.cholesky(expected),
                                         constraint=total)
    torch.testing.assert_close(d.covariance_matrix, reference.covariance_matrix)
