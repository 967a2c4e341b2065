"""Errors that say what to fix: each message names the argument, what it should be and the fix (a transposed ``A``,
an image-shaped ``loc``, a numpy array, a CUDA request without a GPU). Pyro's autoguide on a truncated latent is in
tests/contrib/test_pyro_autoguides.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hardeq
from hardeq import ConstrainedNormal, ConstrainedPoisson, DiagonalCovariance, LinearConstraint, SparseConstraint
from hardeq import SumConstraint

A = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
K = torch.tensor([1.0, -1.0])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("make", [
    lambda: LinearConstraint(A.T, K),
    lambda: LinearConstraint(A.T.expand(3, 6, 2), K),
    lambda: SparseConstraint(A.T.contiguous().to_sparse(), K),
    lambda: SparseConstraint(A.T.contiguous().to_sparse_csr(), K),
], ids=["dense", "batched", "coo", "csr"])
def test_a_transposed_A_is_blamed_on_A_with_the_fix(make):
    with pytest.raises(ValueError, match=r"^A has shape \((3, )?6, 2\), which reads as \(n, a\) = \(6, 2\): k has "
                                         r"a = 2 entries, so A must be \(a, n\) = \(2, 6\).*did you mean A\.T"):
        make()


def test_a_wrong_k_is_still_blamed_on_k():
    with pytest.raises(ValueError, match=r"^k must have shape"):
        LinearConstraint(A, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^k must have shape"):  # a square-ish A: nothing suggests a transpose
        LinearConstraint(torch.randn(2, 2 + 1), torch.zeros(4))


@pytest.mark.parametrize("shape, start", [((3, 4), -2), ((5, 3, 4), -2), ((2, 2, 3), -3)])
def test_an_image_shaped_loc_gets_a_flatten_hint(shape, start):
    n = 12
    c = SumConstraint(torch.zeros(n, dtype=torch.long), torch.zeros(1))
    with pytest.raises(ValueError, match=rf"but loc has size n = {shape[-1]} .*flatten them, "
                                         rf"loc\.flatten\({start}\)"):
        ConstrainedNormal(torch.zeros(shape), 1.0, constraint=c)
    with pytest.raises(ValueError, match=r"loc has size n = 5 \(loc\.shape = \(2, 5\)\)\.$"):  # no false hint
        ConstrainedNormal(torch.zeros(2, 5), 1.0, constraint=c)


@pytest.mark.parametrize("name, call", [
    ("A", lambda: LinearConstraint(A.numpy(), K)),
    ("k", lambda: LinearConstraint(A, K.numpy())),
    ("index", lambda: SumConstraint(np.zeros(6, dtype=np.int64), torch.zeros(1))),
    ("loc", lambda: ConstrainedNormal(np.zeros(6), 1.0, constraint=LinearConstraint(A, K))),
    ("scale", lambda: ConstrainedNormal(torch.zeros(6), np.ones(6), constraint=LinearConstraint(A, K))),
    ("value", lambda: ConstrainedNormal(torch.zeros(6), 1.0, constraint=LinearConstraint(A, K)).log_prob(np.zeros(6))),
    ("rate", lambda: ConstrainedPoisson(np.ones(3), torch.tensor(3))),
])
def test_a_numpy_array_gets_a_conversion_hint(name, call):
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor.*, got numpy\.ndarray.*convert it with "
                                        rf"torch\.as_tensor\({name}\) \(or torch\.from_numpy\({name}\)"):
        call()


def test_a_list_gets_a_conversion_hint():
    with pytest.raises(TypeError, match=r"^scale must be a torch\.Tensor, got list \(a real Python number .*\); "
                                        r"convert it with torch\.tensor\(scale\)\.$"):
        ConstrainedNormal(torch.zeros(6), [1.0] * 6, constraint=LinearConstraint(A, K))


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as one without a usable GPU (whatever it has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("move", [
    lambda: LinearConstraint(A, K).to(device="cuda"),
    lambda: SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1)).to("cuda:0"),
    lambda: SparseConstraint(A.to_sparse(), K).to(device=torch.device("cuda")),
    lambda: DiagonalCovariance(torch.ones(3)).to("cuda"),
], ids=["linear", "sum", "sparse", "covariance"])
def test_a_cuda_request_without_a_gpu_says_so(no_gpu, move):
    with pytest.raises(ValueError, match=r"^device='cuda(:0)?' asks for a GPU, but this torch .*: use device='cpu'"):
        move()


def test_a_cuda_sampler_without_a_gpu_says_so(no_gpu):
    from hardeq.diffusion import DDIMOptions, ddim_sample

    options = DDIMOptions(num_steps=2, num_train_timesteps=10, device="cuda")
    with pytest.raises(ValueError, match=r"^device='cuda' asks for a GPU.*use device='cpu'"):
        ddim_sample(lambda x, t: torch.zeros_like(x), (1, 1, 2, 2), options)


@pytest.mark.parametrize("move", [
    lambda m: m.to("cuda"),
    lambda m: m.to(torch.device("cuda:0"), torch.float64),
    lambda m: m.to(device="cuda", dtype=torch.float64),
    lambda m: m.cuda(),
    lambda m: m.cuda(0),
], ids=["to-str", "to-device-dtype", "to-kwargs", "cuda", "cuda-index"])
def test_a_head_moved_to_cuda_without_a_gpu_says_so(no_gpu, move):
    """The heads are modules: their ``.to`` / ``.cuda`` name the fix instead of torch's AssertionError, and a move
    to the CPU or a dtype still works."""
    from hardeq.nn import ConstrainedGaussianHead

    head = ConstrainedGaussianHead(3, 4, index=torch.zeros(4, dtype=torch.long), constraint_value=1.0)
    with pytest.raises(ValueError, match=r"^device='cuda(:0)?' asks for a GPU, but this torch .*: use device='cpu'"):
        move(head)
    assert head.to("cpu") is head and head.to(torch.float64).linear.weight.dtype == torch.float64


def test_cpu_and_none_devices_pass():
    c = LinearConstraint(A, K)
    assert c.to(device="cpu") is c and c.to() is c
    with pytest.raises(ValueError, match=r"^device must be a torch device"):
        hardeq._validation.check_device("gpu0")
