import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The samplers run many small tensor operations in a loop; on a shared, loaded machine some elementwise
    kernels (sqrt, cos, exp) of torch's intra-op pool then wait ~20 ms each for a second thread. One thread makes
    these tests' duration independent of the machine's load (and is the faster setting for tensors this small)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
