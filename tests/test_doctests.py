"""Docstring examples run as written."""

import doctest
import importlib

import pytest
import torch

import hardeq

MODULES = ["hardeq.constraints.linear", "hardeq.constraints.sum", "hardeq.constraints.sparse",
           "hardeq.distributions.normal", "hardeq.baselines", "hardeq.baselines.projection",
           "hardeq.baselines.elimination", "hardeq.baselines.completion", "hardeq.distributions.poisson",
           "hardeq.testing.exactness"]


@pytest.mark.cpu_only(reason="the examples print CPU tensors")
@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    globs = {"torch": torch, "hardeq": hardeq, **{k: getattr(hardeq, k) for k in hardeq.__all__}}
    result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
