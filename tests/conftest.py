import pytest
import torch


@pytest.fixture(autouse=True)
def _validate_distributions():
    """Tests run with distribution validation on (torch's DistributionsTestCase does the same)."""
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(previous)
