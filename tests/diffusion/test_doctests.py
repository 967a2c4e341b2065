"""The docstring examples of hardeq.diffusion run as written."""

import doctest
import importlib

import pytest
import torch

import hardeq
import hardeq.diffusion

from .conftest import diffusion_names

MODULES = ["hardeq.diffusion.schedules", "hardeq.diffusion.image_constraints", "hardeq.diffusion.conditioning",
           "hardeq.diffusion.ddim", "hardeq.diffusion.ddpm", "hardeq.diffusion.flow", "hardeq.diffusion.options",
           "hardeq.diffusion.noise_schedule"]


@pytest.mark.cpu_only(reason="the examples print CPU tensors")
@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    globs = {"torch": torch, "hardeq": hardeq, **diffusion_names()}
    result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
