"""ATen calls and host reads of issue 39's five hot paths, counted with ``hardeq.testing.count_calls``.

Each path is the steady state of a training loop (the ``A`` / index tensors used before; a freshly built
distribution with ``validate_args=False`` per call; ``tests/budget_cases.py``). Host reads: none, on every path
(each would be a device-to-host synchronisation on a GPU). ATen calls (each a kernel launch on a GPU): at most
:data:`CEILINGS`, the counts of this code, so that a regression fails here. The issue's budgets
(``tests.budget_cases.BUDGETS``): the paths in :data:`MET` meet theirs (B's sample and log_prob, C's sample,
sparse); D's ATen form stays above its budget (26 calls: docs/math.md says why), and D meets it where Triton runs,
with the fused kernels that ``tests/test_fused_kernels.py`` counts.
"""

from __future__ import annotations

import pytest

from hardeq.linalg.device import forced
from hardeq.testing import count_calls
from tests.budget_cases import BUDGETS, PATHS, d_run, d_setup

#: ATen calls per call of each path, as measured on this code (deterministic: a property of the code path)
CEILINGS = {"B sample (n 1e4, a 8, batch 64)": 33, "B log_prob, fresh distribution": 34,
            "D ragged SumConstraint, 128 graphs: rsample + backward": 26, "C sample (n 512, a 256, batch 4)": 48,
            "sparse sample((16,)) (n 2e4, a 100, 40 nnz per row)": 42}
#: the paths whose count meets the issue's budget (``tests.budget_cases.BUDGETS``)
MET = {name for name in CEILINGS if CEILINGS[name] <= BUDGETS[name]}


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
@pytest.mark.parametrize("name", list(PATHS))
def test_hot_path_makes_no_host_read_and_stays_within_its_calls(name):
    setup, run, _ = PATHS[name]
    state = setup()
    with forced("gpu"):  # (the sync-free form: a GPU's; on a CPU, validate_args=False keeps the checked form)
        run(state)
        run(state)  # (an index tensor is laid out at its first two uses)
        with count_calls() as count:
            run(state)
    assert count.host_reads == 0, dict(count.host_read_names)
    assert count.calls <= CEILINGS[name], (count.calls, count.by_name.most_common(10))
    if name in MET:  # (a path that meets the budget must keep meeting it)
        assert count.calls <= BUDGETS[name], (count.calls, count.by_name.most_common(10))


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
def test_a_new_index_tensor_costs_one_host_read():
    """A PyG ``DataLoader`` gives a new ``batch`` vector every step: its layout (sorted, group sizes, groups of
    one) is read once, the only host read of the step."""
    state = d_setup()
    with forced("gpu"):
        d_run(state)
        state["batch"] = state["batch"].clone()
        with count_calls() as count:
            d_run(state)
    assert count.host_reads == 1, dict(count.host_read_names)


@pytest.mark.cpu_only(reason="the cases are built on the CPU")
def test_validated_sampling_reads_the_host():
    """The counter sees the checked (validated) path's reads, so the test above can fail."""
    import hardeq
    from tests.budget_cases import _dense

    s = _dense(1000, 4, 8, seed=0)
    con = hardeq.LinearConstraint(s["A"], s["k"])
    with count_calls() as count:
        hardeq.ConstrainedNormal(s["loc"], s["scale"], constraint=con, validate_args=True).sample()
    assert count.host_reads >= 1


@pytest.mark.cpu_only(reason="the case is built on the CPU")
def test_the_near_square_form_samples_without_its_base_factor():
    """``2a > n`` (the null-space form; not one of the issue's five cases): no host read, and 65 calls, none of them
    the base factor of ``S`` (its Gram product and Cholesky factorisation, which only a KL asks for)."""
    from tests.budget_cases import _dense, _dist

    state = _dense(256, 180, 4, seed=1)
    with forced("gpu"):
        _dist(state).sample()
        _dist(state).sample()
        with count_calls() as count:
            dist = _dist(state)
            dist.sample()
        assert dist.conditioner.method == "nullspace"
    assert count.host_reads == 0, dict(count.host_read_names)
    assert count.calls <= 65, (count.calls, count.by_name.most_common(10))
    assert count.by_name["linalg_cholesky_ex"] == 1  # (the null-space form's own p x p factor only)
