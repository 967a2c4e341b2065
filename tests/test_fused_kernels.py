"""The fused Triton kernels of a ``SumConstraint``'s sync-free sample (``hardeq.linalg.conditioning.grouped_triton``),
run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) with the GPU's choices forced: the kernels' code
is the code a GPU compiles. Checked against the ATen form (same noise: values and gradients), per group (every row
exact), with ``gradcheck``, and for the ATen calls of case D (issue 39's budget: 20).

Needs ``triton`` (every CUDA build of torch installs it; on a CPU ``pip install triton==3.9.0``). Without it the
module is skipped, unless ``HARDEQ_REQUIRE_TRITON=1`` (set by ``.ci/run``, which installs it): then it fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import hardeq
from hardeq.errors import NotPSDError
from hardeq.linalg.device import forced
from hardeq.testing import count_calls

_REQUIRED = os.environ.get("HARDEQ_REQUIRE_TRITON") == "1"
if torch.cuda.is_available():  # (a GPU runs the compiled kernels in the rest of the suite; never interpret there)
    pytest.skip("the interpreted kernels are tested on a machine without a GPU", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    if _REQUIRED:
        raise RuntimeError("triton was imported before this module could select its interpreter: run "
                           "tests/test_fused_kernels.py in a process of its own, or with TRITON_INTERPRET=1")
    pytest.skip("triton was imported outside its interpreter mode", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    if _REQUIRED:
        raise ImportError("HARDEQ_REQUIRE_TRITON=1 but triton is not installed (pip install triton==3.9.0)")
    pytest.skip("needs triton (pip install triton==3.9.0); .ci/run installs it and runs this module",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # (read when triton is imported: its language functions are made for it)
import triton  # noqa: E402, F401

from hardeq.linalg.conditioning import grouped_triton  # noqa: E402
from hardeq.linalg.device import interpreted_kernels  # noqa: E402
from tests.budget_cases import BUDGETS, d_run, d_setup  # noqa: E402

pytestmark = pytest.mark.cpu_only(reason="Triton's interpreter runs the kernels on CPU tensors")
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
D = "D ragged SumConstraint, 128 graphs: rsample + backward"


@pytest.fixture
def fused(monkeypatch):
    """The kernels, interpreted, with the GPU's choices; ``fused(False)`` gives the ATen form."""
    from hardeq.linalg import device

    def choose(on: bool = True):
        monkeypatch.setattr(device, "_interpreted", on)

    with forced("gpu"), interpreted_kernels():
        yield choose


def _sample(index, loc, scale, k, sample_shape=()):
    con = hardeq.SumConstraint(index, k, validate_args=False)
    return hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False).rsample(sample_shape)


def _ratios(index, z, k):
    """Per group and vector: |sum_g z - k| / sum_g |z| (float64)."""
    a = k.shape[-1]
    z64 = z.double()
    sums = torch.zeros(z.shape[:-1] + (a,), dtype=torch.float64).index_add_(-1, index, z64)
    scale = torch.zeros_like(sums).index_add_(-1, index, z64.abs())
    residual = (sums - k.double()).abs()
    return torch.where(scale > 0, residual / scale, residual)  # (a zero group: its residual itself, 0 when exact)


def _ragged(groups: int, largest: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, largest + 1, (groups,), generator=g)
    sizes[::5] = 1  # (groups of one among them)
    return torch.repeat_interleave(torch.arange(groups), sizes)


def test_case_d_meets_its_budget_with_no_host_read(fused):
    state = d_setup()
    d_run(state)
    d_run(state)
    with count_calls() as count:
        d_run(state)
    assert count.host_reads == 0, dict(count.host_read_names)
    assert count.by_name["exact_sum_forward"] == 1 and count.by_name["exact_sum_backward"] == 1
    assert count.calls <= BUDGETS[D], (count.calls, count.by_name.most_common())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["shared", "rows", "shared loc, rows of k"])
def test_values_and_gradients_equal_the_aten_form_and_every_group_is_exact(fused, dtype, layout):
    g = torch.Generator().manual_seed(3)
    index = _ragged(40, 70, seed=1)
    n, a = index.shape[0], 40
    batch = () if layout == "shared" else (3,)
    loc_shape = (n,) if layout != "rows" else batch + (n,)
    loc = (torch.randn(loc_shape, generator=g, dtype=dtype) * 5).requires_grad_()
    scale = (10 ** (2 * torch.rand(loc_shape, generator=g, dtype=dtype) - 1)).requires_grad_()
    k = (torch.randn(batch + (a,), generator=g, dtype=dtype) * 10).requires_grad_()
    weights = torch.randn((2,) + batch + (n,), generator=g, dtype=dtype)
    out = {}
    for on in (True, False):
        fused(on)
        torch.manual_seed(11)
        with count_calls() as count:
            z = _sample(index, loc, scale, k, (2,))
        assert (count.by_name["exact_sum_forward"] == 1) == on
        grads = torch.autograd.grad((z * weights).sum(), (loc, scale, k))
        out[on] = (z.detach(), grads)
    (z, grads), (z_ref, grads_ref) = out[True], out[False]
    assert _ratios(index, z, k.detach()).max() <= TOL[dtype]
    singles = torch.bincount(index, minlength=a) == 1
    assert torch.equal(z[..., singles[index]], k.detach().expand(z.shape[:-1] + (a,))[..., singles])
    # The two forms sum each group in a different order (a tree; a segment reduction): each float64 group sum is
    # within n_g u64 of the group's absolute sum, so z agrees to a few units of the working dtype, except the last
    # member, which takes the group's float64 residual (up to about 2 n_g u64 sum_g |z| apart); the gradients' group
    # sums q likewise, to n_g units of the working dtype of the largest gradient.
    eps, u64 = torch.finfo(dtype).eps, 2.0**-53
    sizes = torch.bincount(index, minlength=a)
    group_abs = torch.zeros(z_ref.shape[:-1] + (a,), dtype=torch.float64).index_add_(-1, index, z_ref.double().abs())
    last = torch.zeros(n, dtype=torch.bool)
    last[torch.cumsum(sizes, 0) - 1] = True
    repair = 4 * sizes.double().index_select(0, index) * u64 * group_abs.index_select(-1, index) * last
    assert ((z - z_ref).abs().double() <= 64 * eps * (z_ref.abs() + z_ref.abs().amax()).double() + repair).all()
    largest = int(sizes.max())
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=64 * eps, atol=4 * largest * eps * want.abs().amax().item())


@pytest.mark.parametrize("wanted", ["loc", "scale", "k"])
def test_a_gradient_for_one_input_only(fused, wanted):
    """The kernels skip the scale's gradient factor when the scale needs none; each gradient alone equals the
    ATen form's."""
    g = torch.Generator().manual_seed(6)
    index = _ragged(12, 30, seed=3)
    n, a = index.shape[0], 12
    inputs = {"loc": torch.randn(n, generator=g, dtype=torch.float64),
              "scale": torch.rand(n, generator=g, dtype=torch.float64) + 0.5,
              "k": torch.randn(a, generator=g, dtype=torch.float64)}
    inputs[wanted].requires_grad_()
    weights = torch.randn(n, generator=g, dtype=torch.float64)
    grads = []
    for on in (True, False):
        fused(on)
        torch.manual_seed(2)
        z = _sample(index, inputs["loc"], inputs["scale"], inputs["k"])
        grads.append(torch.autograd.grad((z * weights).sum(), inputs[wanted])[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_far_offsets_and_scales_over_decades_stay_exact_in_float32(fused):
    g = torch.Generator().manual_seed(4)
    index = _ragged(30, 200, seed=2)
    n, a = index.shape[0], 30
    loc = 1e8 * (1 + torch.rand(n, generator=g))
    scale = 10 ** (6 * torch.rand(n, generator=g) - 3)
    k = torch.zeros(a)
    z = _sample(index, loc, scale, k, (8,))
    assert torch.isfinite(z).all() and _ratios(index, z, k).max() <= TOL[torch.float32]


def test_gradcheck_in_float64(fused):
    index = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
    g = torch.Generator().manual_seed(5)
    inputs = (torch.randn(10, generator=g, dtype=torch.float64).requires_grad_(),
              (torch.rand(10, generator=g, dtype=torch.float64) + 0.5).requires_grad_(),
              torch.randn(4, generator=g, dtype=torch.float64).requires_grad_())

    def sample(loc, scale, k):
        torch.manual_seed(0)
        return _sample(index, loc, scale, k, (2,))

    assert torch.autograd.gradcheck(sample, inputs)


def test_a_non_finite_scale_raises_naming_its_group(fused):
    index = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    scale = torch.ones(7)
    scale[5] = float("inf")
    with pytest.raises(NotPSDError, match="First such group: 2 of 3"):
        _sample(index, torch.zeros(7), scale, torch.ones(3))


def test_a_second_derivative_raises(fused):
    index = torch.tensor([0, 0, 1, 1, 1])
    scale = torch.ones(5, dtype=torch.float64, requires_grad=True)
    z = _sample(index, torch.zeros(5, dtype=torch.float64), scale, torch.tensor([1.0, 2.0], dtype=torch.float64))
    (grad,) = torch.autograd.grad(z.square().sum(), scale, create_graph=True)
    with pytest.raises(RuntimeError):  # never a silently wrong second derivative
        grad.sum().backward()


def test_groups_above_the_kernels_block_and_unsorted_indices_take_the_aten_form(fused):
    big = torch.repeat_interleave(torch.arange(2), torch.tensor([grouped_triton.MAX_GROUP + 1, 3]))
    unsorted = torch.tensor([1, 0, 1, 0, 2, 2])
    for index in (big, unsorted):
        n, a = index.shape[0], int(index.max()) + 1
        with count_calls() as count:
            z = _sample(index, torch.zeros(n), torch.ones(n), torch.ones(a))
        assert count.by_name["exact_sum_forward"] == 0
        assert _ratios(index, z, torch.ones(a)).max() <= TOL[torch.float32]


_COMPILE_AHEAD = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from hardeq.linalg.conditioning.grouped_triton import _kernels

forward, backward = _kernels()
arguments = {
    forward: {"offsets_ptr": "*i64", "sums_ptr": "*fp64", "flag_ptr": "*i32", "n": "i32", "a": "i32", "rows": "i32",
              "loc_rows": "i32", "scale_rows": "i32", "k_rows": "i32"},
    backward: {"sums_ptr": "*fp64", "offsets_ptr": "*i64", "n": "i32", "a": "i32", "grad_row_stride": "i32",
               "grad_stride": "i32", "scale_rows": "i32"},
}
flags = {forward: "NEED_H", backward: "NEED_SCALE"}
for capability in (80, 90):
    for fn, fixed in arguments.items():
        for dtype in ("fp32", "fp64"):
            for need in (True, False):
                for block in (16, 4096):
                    constants = {flags[fn]: need, "BLOCK": block}
                    signature = {name: "constexpr" if name in constants else fixed.get(name, "*" + dtype)
                                 for name in fn.arg_names}
                    source = triton.compiler.ASTSource(
                        fn=fn, signature=signature,
                        constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()})
                    kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32))
                    assert kernel.asm.get("cubin"), (capability, fn, dtype, need, block)
print("compiled")
'''


def test_the_kernels_compile_for_a100_and_h100_class_gpus(tmp_path):
    """Triton's own compiler (not the interpreter) turns both kernels into PTX and, with its bundled ``ptxas``, into
    machine code for compute capabilities 8.0 and 9.0, in both dtypes, with and without the scale's gradient, at the
    smallest and largest block: what a GPU would compile at its first launch. No GPU needed."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _COMPILE_AHEAD], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_a_first_launch_that_cannot_compile_warns_and_leaves_the_aten_form(fused, monkeypatch):
    """Triton installed but unable to build (no C compiler for its launcher, ...): the sample still comes, by the
    ATen form, with one warning; the kernels are not tried again on that device."""
    def broken():
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(grouped_triton, "_kernels", broken)
    monkeypatch.setattr(grouped_triton, "_LAUNCHED", set())
    monkeypatch.setattr(grouped_triton, "_UNUSABLE", set())
    index = torch.tensor([0, 0, 1, 1, 1])
    with pytest.warns(RuntimeWarning, match="could not run on cpu .*C compiler"):
        z = _sample(index, torch.zeros(5), torch.ones(5), torch.tensor([1.0, 2.0]))
    assert _ratios(index, z, torch.tensor([1.0, 2.0])).max() <= TOL[torch.float32]
    assert grouped_triton._UNUSABLE == {"cpu"}
    with count_calls() as count:
        _sample(index, torch.zeros(5), torch.ones(5), torch.tensor([1.0, 2.0]))
    assert count.by_name["exact_sum_forward"] == 0
