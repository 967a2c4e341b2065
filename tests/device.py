"""The device the library tests run on: ``pytest --device {cpu,cuda}`` (default ``cpu``).

``tests/conftest.py`` sets it when pytest starts. Under ``--device cuda`` it also makes CUDA torch's default device
for the whole session (``torch.set_default_device``), so every tensor a test or a shared builder creates without
naming a device (``torch.randn``, ``torch.tensor``, ``torch.zeros`` ...) is on the GPU; and it installs
:class:`HostGenerators`, so that draws from a seeded CPU ``torch.Generator`` give the same numbers on both devices.
Tests that need the device by name use the ``device`` fixture or :func:`device`.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._device import _device_constructors

__all__ = ["HostGenerators", "device", "set_device"]

_DEVICE = torch.device("cpu")


def device() -> torch.device:
    """The device the suite runs on (``torch.device("cpu")`` unless ``pytest --device cuda``)."""
    return _DEVICE


def set_device(name: str) -> torch.device:
    """Set the suite's device (called once by ``tests/conftest.py``); returns it."""
    global _DEVICE
    _DEVICE = torch.device(name)
    return _DEVICE


def _is_cpu_generator(g: object) -> bool:
    return isinstance(g, torch.Generator) and g.device.type == "cpu"


def _to(x: object, target: torch.device) -> object:
    """``x`` with every tensor in it (nested tuples and lists too) moved to ``target``."""
    if isinstance(x, torch.Tensor):
        return x.to(target)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, target) for v in x)
    return x


class HostGenerators(TorchFunctionMode):
    """Under ``--device cuda``: a seeded CPU ``torch.Generator`` keeps working, and gives the same numbers as on CPU.

    Most tests (and :mod:`hardeq.testing`'s conformance cases, written as users write them) draw their data with
    ``torch.randn(..., generator=torch.Generator().manual_seed(s))``; with CUDA as the default device torch refuses
    a CPU generator. This mode runs such a call on the host and moves the result to the GPU: a factory function
    (``randn``, ``rand``, ``randint``, ``randperm`` ...) is called with ``device="cpu"``; any other function given a
    CPU generator (``normal``, ``poisson``, ``multinomial``, ``Tensor.normal_`` ...) gets its tensor arguments on the
    host, and an in-place one copies its result back into its GPU tensor. It also hands NumPy a host copy of a GPU
    tensor (``.numpy()``, ``np.asarray(t)``), as the tests' NumPy/SciPy oracles need. Everything else passes through.
    """

    def __init__(self, target: torch.device) -> None:
        super().__init__()
        self.target = torch.device(target)
        self._factories = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and args and args[0].device.type != "cpu":
            return func(args[0].detach().cpu(), *args[1:], **kwargs)
        if not _is_cpu_generator(kwargs.get("generator")):
            return func(*args, **kwargs)
        if func in self._factories:
            target = torch.device(kwargs.pop("device", None) or self.target)
            if target.type == "cpu":  # asked for the host by name: keep it there (the default device is the GPU)
                return func(*args, device=target, **kwargs)
            return func(*args, device="cpu", **kwargs).to(target)
        on_device = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"]
        if not on_device:
            return func(*args, **kwargs)
        target = on_device[0].device
        out = func(*_to(args, torch.device("cpu")), **{k: _to(v, torch.device("cpu")) for k, v in kwargs.items()})
        if resolve_name(func) is not None and resolve_name(func).endswith("_") and args[0] is on_device[0]:
            return args[0].copy_(out)  # in place (Tensor.normal_, ...): write into the caller's tensor
        return _to(out, target)
