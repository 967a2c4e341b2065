"""The docstring examples of the bounds modules run as written."""

import doctest
import importlib

import pytest
import torch

import hardeq

MODULES = ["hardeq.distributions.truncated"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    globs = {"torch": torch, "hardeq": hardeq}
    result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
