"""Tests of the ``portfolio`` study: data windows, StemGNN, weight heads, classical allocations, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hardeq_studies.portfolio.classical import (
    ledoit_wolf,
    max_sharpe_long_only,
    min_variance,
    project_simplex,
)
from hardeq_studies.portfolio.data import load_data, load_prices, make_windows
from hardeq_studies.portfolio.models import StemGNN, StemGNNBlock, chebyshev_filter
from hardeq_studies.portfolio.task import METHODS, OURS, WeightHead, selection_score, sharpe, sum_residual

PERIODS = {"train": ["2015-01-01", "2016-12-31"], "val": ["2017-01-01", "2017-12-31"],
           "test": ["2018-01-01", "2018-12-31"]}


def _tol(w: torch.Tensor) -> torch.Tensor:
    """Round-off bound of a sum of ``N`` numbers: ``4 N eps sum|w|``."""
    eps = torch.finfo(w.dtype).eps
    return 4 * w.shape[-1] * eps * w.abs().sum(-1).to(torch.float64)


# ----------------------------------------------------------------------------------------------- data
def test_shipped_tables():
    big = load_prices("sp500")
    assert big.prices.shape == (1440, 471) and len(big.tickers) == 471
    assert str(big.dates[0]) == "2015-01-05" and str(big.dates[-1]) == "2020-09-22"
    years = big.dates.astype("datetime64[Y]").astype(int) + 1970
    assert (years == 2019).sum() == 252 and (years == 2018).sum() == 251
    small = load_prices("sp500_20")
    assert small.prices.shape == (8313, 20) and "AAPL" in small.tickers
    with pytest.raises(ValueError, match="dataset"):
        load_prices("nasdaq")


def test_windows_have_no_look_ahead():
    data = load_data("sp500", PERIODS, 120, 120, num_assets=30, asset_seed=1)
    dates = data.table.dates
    for name, w in data.splits.items():
        lo, hi = data.rows[name]
        held_last = w.start + data.horizon - 1
        assert (w.start >= lo).all() and (held_last <= hi).all(), name
        assert len(w) == hi - max(lo, 120) - 120 + 2  # every decision whose held days fit (stride 1)
        np.testing.assert_allclose(w.inputs[:, -1], 1.0)
        # returns compound to the future relative prices; the first return uses the last input close
        np.testing.assert_allclose(np.cumprod(1 + w.returns, axis=1), w.future, rtol=1e-12)
        np.testing.assert_allclose(w.inputs, data.table.prices[w.start[:, None] + np.arange(-120, 0)]
                                   / data.table.prices[w.start - 1][:, None], rtol=1e-12)
    # a split's last held day precedes the next split's first held day
    assert dates[data.splits["train"].start[-1] + 119] < np.datetime64(PERIODS["val"][0])
    assert dates[data.splits["val"].start[-1] + 119] < np.datetime64(PERIODS["test"][0])
    assert data.num_assets == 30 and data.table.tickers == sorted(data.table.tickers)


def test_data_argument_errors():
    with pytest.raises(ValueError, match="time order"):
        load_data("sp500", {**PERIODS, "val": ["2016-06-01", "2017-12-31"]}, 20, 20)
    with pytest.raises(ValueError, match="no window"):
        load_data("sp500", {**PERIODS, "test": ["2018-01-01", "2018-02-15"]}, 20, 60)
    with pytest.raises(ValueError, match="stride"):
        make_windows(np.ones((50, 3)), 0, 49, 10, 10, stride=0)
    with pytest.raises(ValueError, match="num_assets"):
        load_data("sp500", PERIODS, 20, 20, num_assets=1)


# ------------------------------------------------------------------------------------------- StemGNN
def test_stemgnn_shapes_and_gradients():
    torch.manual_seed(0)
    B, T, H, N = 3, 20, 10, 6
    model = StemGNN(N, T, H, stacks=2, order=3, multi=2, modes=None, gru_hidden=4, gru_chunk=5, dropout=0.0,
                    weight_outputs=2)
    x = 0.1 * torch.randn(B, T, N)
    forecast, raw = model(x)
    assert forecast.shape == (B, H, N) and raw.shape == (B, N, 2)
    (forecast.square().mean() + raw.square().mean()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    with pytest.raises(ValueError, match="x must be"):
        model(torch.randn(B, T, N + 1))
    with pytest.raises(ValueError, match="gru_chunk"):
        StemGNN(N, 21, H, gru_chunk=5)


def test_chebyshev_filter_is_the_rescaled_laplacian():
    torch.manual_seed(1)
    att = torch.softmax(torch.randn(2, 5, 5, dtype=torch.float64), -1)
    x = torch.randn(2, 5, 7, dtype=torch.float64)
    g = chebyshev_filter(att, x, 3)
    A = 0.5 * (att + att.transpose(-1, -2))
    d = A.sum(-1) ** -0.5
    L = torch.eye(5, dtype=torch.float64) - d[..., :, None] * A * d[..., None, :]
    L_hat = L - torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(g[:, 0], x)
    torch.testing.assert_close(g[:, 1], L_hat @ x)
    torch.testing.assert_close(g[:, 2], 2 * L_hat @ L_hat @ x - x)
    ev = torch.linalg.eigvalsh(L_hat)
    assert ev.min() >= -1 - 1e-12 and ev.max() <= 1 + 1e-12


def test_spectral_cell_inverts_the_dft():
    """With identity GLUs the cell is irfft(rfft(g)) (all frequencies) or a low-pass (``modes``)."""
    g = torch.randn(2, 3, 4, 16, dtype=torch.float64)
    block = StemGNNBlock(16, 3, 1, backcast=False).double()
    block.glu_real = block.glu_imag = torch.nn.Identity()
    torch.testing.assert_close(block.spectral_cell(g), g)
    low = StemGNNBlock(16, 3, 1, backcast=False, modes=3).double()
    low.glu_real = low.glu_imag = torch.nn.Identity()
    spec = torch.fft.rfft(g, dim=-1)
    spec[..., 3:] = 0
    torch.testing.assert_close(low.spectral_cell(g), torch.fft.irfft(spec, n=16, dim=-1))


# -------------------------------------------------------------------------------------- weight heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", METHODS)
def test_every_head_sums_to_one(method, dtype):
    torch.manual_seed(2)
    N = 471
    head = WeightHead(method, N, mc_samples=5)
    raw = (3 * torch.randn(4, N, head.outputs, dtype=dtype)).requires_grad_(True)
    w = head.weights(raw)
    assert w.shape == (4, N)
    assert (sum_residual(w) <= _tol(w)).all(), sum_residual(w)
    ws = head.training_weights(raw)
    assert ws.shape == ((5 if method in OURS else 1), 4, N)
    assert (sum_residual(ws) <= _tol(ws)).all()
    if method == "StemGNN":
        assert (w > 0).all()
    else:
        assert (w < 0).any()  # shorting is possible for the linear heads
    if method == "StemGNN-KKThPINN":
        y = (1 + raw[..., 0]) / N
        torch.testing.assert_close(w, y - y.mean(-1, keepdim=True) + 1 / N)
    r = 0.01 * torch.randn(4, 30, N, dtype=dtype)
    sharpe(ws, r).mean().backward()
    assert torch.isfinite(raw.grad).all() and raw.grad[..., 0].abs().max() > 0


def test_ours_estimators_share_the_mean_gradient_not_the_variance_gradient():
    torch.manual_seed(3)
    N = 8
    raw = torch.randn(2, N, 2, dtype=torch.float64)
    r = 0.01 * torch.randn(2, 40, N, dtype=torch.float64)
    grads = {}
    for method in OURS:
        x = raw.clone().requires_grad_(True)
        torch.manual_seed(4)
        sharpe(WeightHead(method, N, mc_samples=3).training_weights(x), r).sum().backward()
        grads[method] = x.grad
    me, pw = grads["ours"], grads["ours-pathwise"]
    torch.testing.assert_close(me[..., 0], pw[..., 0])
    assert not torch.allclose(me[..., 1], pw[..., 1])


def test_sharpe_matches_the_mean_covariance_form():
    torch.manual_seed(5)
    r = 0.02 * torch.randn(3, 50, 4, dtype=torch.float64) + 0.001
    w = torch.softmax(torch.randn(3, 4, dtype=torch.float64), -1)
    for b in range(3):
        mu = 252 * r[b].mean(0)
        cov = 252 * torch.cov(r[b].T)
        ref = (w[b] @ mu - 0.03) / torch.sqrt(w[b] @ cov @ w[b])
        torch.testing.assert_close(sharpe(w, r)[b], ref)
    with pytest.raises(ValueError, match="method"):
        WeightHead("softmax", 4)


def test_ours_diagnostics_see_unequal_variances():
    """Equal variances: the conditional mean is the KKT projection of the mean (gap 0, CV 0, ratio 1); unequal
    variances with ``sum(mu) != 1``: it is not."""
    torch.manual_seed(7)
    N = 12
    head = WeightHead("ours", N)
    raw = torch.randn(3, N, 2, dtype=torch.float64)
    raw[..., 1] = 0.7
    d = head.diagnostics(raw)
    assert d["gap_to_projection"].max() < 1e-15 and d["var_cv"].max() < 1e-12
    torch.testing.assert_close(d["var_ratio"], torch.ones(3, dtype=torch.float64))
    y = (1 + raw[..., 0]) / N
    torch.testing.assert_close(head.weights(raw), y - y.mean(-1, keepdim=True) + 1 / N)
    raw[..., 1] = torch.randn(3, N, dtype=torch.float64)
    d = head.diagnostics(raw)
    assert (d["gap_to_projection"] > 1e-4).all() and (d["var_cv"] > 0.1).all() and (d["var_ratio"] > 2).all()
    v = head.variances(raw)
    torch.testing.assert_close(d["var_ratio"], v.amax(-1) / v.amin(-1))
    with pytest.raises(ValueError, match="diagnostics"):
        WeightHead("StemGNN-KKThPINN", N).diagnostics(raw)


def test_selection_rule():
    from hardeq_studies.portfolio.run import selection_options

    assert np.isnan(selection_score([1.0, 2.0], 3, 2))
    assert selection_score([1.0, 2.0, 4.0], 3, 2) == -3.0
    assert selection_score([5.0, 0.0, 1.0, 2.0], 3, 3) == -1.0
    with pytest.raises(ValueError, match="smooth"):
        selection_score([1.0], 1, 2)
    assert selection_options({"min_epochs": 5, "smooth": 3, "patience": 5}, 20) == (5, 3)
    assert selection_options({"min_epochs": 5, "smooth": 3, "patience": 5}, 2) == (2, 2)
    with pytest.raises(ValueError, match="patience"):
        selection_options({"min_epochs": 5, "smooth": 3, "patience": 4}, 20)


def test_ours_starts_from_the_shared_network_with_unequal_variances():
    from hardeq_studies.portfolio.data import load_config
    from hardeq_studies.portfolio.run import build_model, prepare, settings

    s = settings(load_config(), "quick")
    data = prepare(s, "sp500_20-10")
    x = torch.as_tensor(data.splits["val"].inputs[:4], dtype=torch.float32) - 1
    kkt = build_model(s, data, "StemGNN-KKThPINN", 3).eval()
    ours = build_model(s, data, "ours", 3).eval()
    again = build_model(s, data, "ours", 3).eval()
    with torch.no_grad():
        (f0, r0), (f1, r1), (_, r2) = kkt(x), ours(x), again(x)
    torch.testing.assert_close(f1, f0)
    torch.testing.assert_close(r1[..., 0], r0[..., 0])  # the mean output is the other methods'
    torch.testing.assert_close(r2, r1)  # seeded
    d = WeightHead("ours", data.num_assets).diagnostics(r1.to(torch.float64))
    assert (d["var_ratio"] > 2).all() and (d["gap_to_projection"] > 0).all()
    with pytest.raises(ValueError, match="log_var_bias"):
        StemGNN(4, 10, 5, gru_chunk=5, log_var_bias=True)


def test_claim_verdicts():
    from hardeq_studies.claims import decide
    from hardeq_studies.portfolio.report import claims

    def doc(p, diff):
        tests = [{"universe": "u", "a": "ours", "b": b, "p": p, "n": 10, "median_diff": diff, "a_higher": 8}
                 for b in ("StemGNN", "StemGNN-KKThPINN", "StemGNN-CL")]
        values = {m: (1.0, 0.1) for m in ("ours", "StemGNN", "StemGNN-KKThPINN", "StemGNN-CL")}
        return {"universes": ["u"], "significance": tests, "config": {"paper": {"values": values}},
                "per_run": {"u": {"ours": {"max_gap_to_projection": [1.0]}}}, "data": {"u": {"num_assets": 5}}}

    verdicts = [d.verdict for d in decide(claims(doc(0.002, 0.2)))]
    assert verdicts == ["reproduced (Wilcoxon, n = 10)"] * 3  # Holm over 3: 0.006 < 0.05
    # against the paper: the universes and StemGNN differ from the paper's, so never "refuted"
    assert all(v.startswith("not reproduced at this budget (Wilcoxon, n = 10; significant the other way, but the "
                            "universes") for v in (d.verdict for d in decide(claims(doc(0.002, -0.2)))))
    assert all(d.verdict.startswith("undecided (Wilcoxon, n = 10; more runs") for d in decide(claims(doc(0.3, 0.2))))
    assert decide(claims(doc(0.02, 0.2)))[0].p_holm == pytest.approx(0.06)


# -------------------------------------------------------------------------------------- classical
def test_classical_allocations():
    from scipy.optimize import minimize

    torch.manual_seed(6)
    v = torch.randn(50, 7, dtype=torch.float64)
    p = project_simplex(v)
    assert (p >= 0).all() and torch.allclose(p.sum(-1), torch.ones(50, dtype=torch.float64))
    for i in range(5):  # the projection is the closest simplex point among random ones
        q = torch.distributions.Dirichlet(torch.ones(7, dtype=torch.float64)).sample((200,))
        assert (p[i] - v[i]).norm() <= (q - v[i]).norm(dim=-1).min() + 1e-12
    x = 0.01 * torch.randn(2, 60, 5, dtype=torch.float64) + torch.tensor([0.002, 0.001, 0.0, -0.001, 0.0015],
                                                                        dtype=torch.float64)
    cov = ledoit_wolf(x)
    torch.testing.assert_close(cov, cov.transpose(-1, -2))
    assert (torch.linalg.eigvalsh(cov) > 0).all()
    w = max_sharpe_long_only(x, steps=1500)
    mu, S = 252 * x.mean(1), 252 * ledoit_wolf(x)
    for b in range(2):
        def neg(z, b=b):
            return -(z @ mu[b].numpy() - 0.03) / np.sqrt(z @ S[b].numpy() @ z)
        ref = minimize(neg, np.full(5, 0.2), method="SLSQP", bounds=[(0, 1)] * 5,
                       constraints=[{"type": "eq", "fun": lambda z: z.sum() - 1}])
        assert -neg(w[b].numpy()) >= -ref.fun - 1e-4
        assert abs(float(w[b].sum()) - 1) < 1e-12 and (w[b] >= 0).all()
    g = min_variance(x)
    assert torch.allclose(g.sum(-1), torch.ones(2, dtype=torch.float64))
    var = torch.einsum("bi,bij,bj->b", g, S, g)
    for _ in range(20):  # no feasible perturbation lowers the variance
        d = torch.randn(5, dtype=torch.float64)
        d -= d.mean()
        h = g + 1e-3 * d
        assert (torch.einsum("bi,bij,bj->b", h, S, h) >= var - 1e-15).all()


# ------------------------------------------------------------------------------------------- the CLI


@pytest.mark.slow
def test_quick_preset_end_to_end_through_the_cli(tmp_path):
    from hardeq_studies.cli import main

    assert main(["reproduce", "portfolio", "--preset", "quick", "--out", str(tmp_path), "--quiet"]) == 0
    doc = json.loads((tmp_path / "portfolio.json").read_text())
    universes = ["sp500_20-10", "sp500_20-20"]
    assert doc["universes"] == universes and {r["dataset"] for r in doc["records"]} == set(universes)
    methods = {r["method"] for r in doc["records"] if r.get("variant") != "long-only"}
    assert set(METHODS) | {"equal-weight", "Markowitz", "min-variance"} == methods
    # the long-only variant (portfolio/bounds.py): every rule long-only and summing to one, its own claims section
    from hardeq_studies.portfolio.bounds import RULES, TRAINED_RULES

    for u in universes:
        part = doc["long_only"][u]
        for rule in (*RULES[1:], *TRAINED_RULES):  # with the network trained through the truncated likelihood
            assert max(part["per_run"][rule]["max_violation"]) == 0.0
            assert max(part["per_run"][rule]["max_sum_residual"]) < 1e-12
            assert len(part["per_run"][rule]["test_sharpe"]) == 2
        assert len(part["significance"]) == 5 and len(part["trained"]["best_epoch"]) == 2
        for sampler in part["sampler"]:  # how each run's truncated mean was drawn, with its diagnostics
            assert sampler["method"] in ("rejection", "gibbs")
            assert (sampler["max_rhat"] is None) == (sampler["method"] == "rejection")
    paper = {r["method"]: r["paper"] for r in doc["records"] if r["metric"] == "test_sharpe"}
    assert paper["ours"] == 1.9041 and paper["StemGNN-CL"] == 1.5018
    for u in universes:
        assert doc["data"][u]["num_assets"] == int(u.split("-")[1])
        assert doc["data"][u]["test"]["period"] == ["2021-01-01", "2021-12-31"]
        for m, runs in doc["per_run"][u].items():
            assert len(runs["test_sharpe"]) == 2 and all(np.isfinite(runs["test_sharpe"]))
            assert max(runs["max_sum_residual"]) < 1e-13, m  # heads applied in float64 at evaluation
            assert ("var_cv" in runs) == (m in OURS)
        for m in OURS:  # the variances differ, so ours is not the KKT projection of its own mean
            assert min(doc["per_run"][u][m]["var_ratio"]) > 1.5 and min(doc["per_run"][u][m]["var_cv"]) > 0.1
            assert min(doc["per_run"][u][m]["max_gap_to_projection"]) > 1e-4
        assert all(e == 2 for m in METHODS for e in doc["training"][u][m]["best_epoch"])
    assert len(doc["significance"]) == 2 * 2 * 7 and all("p" in s for s in doc["significance"])
    for name in ("portfolio.md", "portfolio_cumulative.png", "portfolio_weights.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert not (tmp_path / "checkpoints").exists()
    md = (tmp_path / "portfolio.md").read_text()
    assert "Table 7" in md and "Table 9" not in md and "Wilcoxon" in md and "## Claims of the paper" in md
    claims = md.split("## Claims of the paper")[1].split("\n## ")[0]
    # 2 runs decide nothing
    assert claims.count(": ours beats") == 3 * 2 and claims.count("undecided (Wilcoxon, n = 2") == 3 * 2
    bounds_section = md.split("## Long-only variant: do the bounds help?")[1].split("\n## ")[0]
    assert bounds_section.count("undecided (Wilcoxon, n = 2") == 5 * 2  # 2 runs decide nothing here either
    (tmp_path / "portfolio.md").unlink()
    assert main(["report", "portfolio", "--out", str(tmp_path), "--quiet"]) == 0
    assert (tmp_path / "portfolio.md").read_text() == md


@pytest.mark.slow
def test_resume_recomputes_only_missing_units_bit_exactly(tmp_path):
    from hardeq_studies.cli import main
    from hardeq_studies.harness import atomic_torch_save, load_checkpoint

    args = ["reproduce", "portfolio", "--preset", "quick", "--epochs", "1", "--out", str(tmp_path), "--quiet"]
    assert main([*args, "--keep-checkpoints"]) == 0
    full = json.loads((tmp_path / "portfolio.json").read_text())
    path = tmp_path / "checkpoints" / "portfolio-quick.pt"
    ck = load_checkpoint(path)
    drop = ("sp500_20-10/run1/ours", "sp500_20-20/run0/StemGNN-CL", "sp500_20-20/classical")
    assert set(drop) <= set(ck["blocks"])
    blocks = {k: v for k, v in ck["blocks"].items() if k not in drop}
    atomic_torch_save({"fingerprint": ck["fingerprint"], "blocks": blocks}, path)
    assert main([*args, "--resume"]) == 0
    resumed = json.loads((tmp_path / "portfolio.json").read_text())
    assert resumed["per_run"] == full["per_run"] and resumed["records"] == full["records"]
    assert resumed["training"] == full["training"] and resumed["significance"] == full["significance"]
    assert not path.exists()
    atomic_torch_save({"fingerprint": "another run", "blocks": {}}, path)
    assert main([*args, "--resume"]) == 2  # a checkpoint of another run is refused (ValueError -> exit 2)


@pytest.mark.slow
def test_mixing_diagnostic_writes_its_report(tmp_path, monkeypatch):
    """``python -m hardeq_studies.portfolio.mixing`` retrains one cpu-preset run and writes its diagnostic."""
    from hardeq_studies import results
    from hardeq_studies.portfolio import bounds, mixing

    monkeypatch.setattr(results, "_ALLOW_DIRTY", True)
    out = tmp_path / "mixing.md"
    mixing.main(["--universe", "sp500-50", "--run", "0", "--windows", "2", "--per-chain", "4", "--burn-ins", "5,10",
                 "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# Portfolio long-only variant: how well the truncated mean is estimated")
    assert "Command: `python -m hardeq_studies.portfolio.mixing --universe sp500-50" in text
    assert text.count("- burn-in ") == 2 and "the study's estimate against the last" in text
    assert bounds.long_only_weights.__name__ == "long_only_weights"  # the study's function is restored
