"""A guard that fails on any host synchronisation inside a block, on any device (CPU included).

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` raises when a kernel's result is copied to the host. The same
operations are no copy on CPU, so a CPU test could not see them; :class:`forbid_host_sync` names them instead, as a
``TorchFunctionMode`` that raises :class:`HostSyncError` when one of them is called inside the block:

- reading a tensor's value into Python: ``item``, ``tolist``, ``bool()``/``int()``/``float()``/``index``,
  ``numpy``, ``torch.equal``, ``torch.allclose``, ``torch.is_nonzero``, formatting a tensor into a string;
- moving a tensor to the host: ``cpu()``, ``to("cpu")``; making one from Python data (``torch.tensor(1.0)``,
  ``as_tensor``, ``asarray``, ``new_tensor``), which on a GPU is a copy from pageable host memory, not allowed
  while a CUDA graph is being captured;
- operations whose output size depends on the values: ``nonzero``, ``argwhere``, ``masked_select``, ``unique``,
  ``unique_consecutive``, ``bincount``, ``repeat_interleave`` without ``output_size``, indexing with a boolean tensor;
- linear algebra that checks its result on the host: ``cholesky``, ``inv``, ``solve``, ``eigh``, ``eigvalsh``,
  ``lu_factor``, ``cholesky_ex``/``inv_ex``/``solve_ex``/``lu_factor_ex`` with ``check_errors=True``.

Used by the default suite (``tests/test_host_sync.py``) to check that the static and grouped paths make no host
synchronisation, and so can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, resolve_name

__all__ = ["HostSyncError", "forbid_host_sync"]

_T = torch.Tensor

#: functions that read values to the host or size their output by them
_ALWAYS = {
    _T.item: "Tensor.item", _T.tolist: "Tensor.tolist", _T.__bool__: "bool(tensor)", _T.__int__: "int(tensor)",
    _T.__float__: "float(tensor)", _T.__index__: "operator.index(tensor)", _T.numpy: "Tensor.numpy",
    _T.cpu: "Tensor.cpu", _T.__format__: "format(tensor)", _T.__repr__: "repr(tensor)",
    torch.equal: "torch.equal", _T.equal: "Tensor.equal", torch.allclose: "torch.allclose",
    _T.allclose: "Tensor.allclose", torch.is_nonzero: "torch.is_nonzero", _T.is_nonzero: "Tensor.is_nonzero",
    torch.nonzero: "torch.nonzero", _T.nonzero: "Tensor.nonzero", torch.argwhere: "torch.argwhere",
    _T.argwhere: "Tensor.argwhere", torch.masked_select: "torch.masked_select",
    _T.masked_select: "Tensor.masked_select", torch.unique: "torch.unique", _T.unique: "Tensor.unique",
    torch.unique_consecutive: "torch.unique_consecutive", _T.unique_consecutive: "Tensor.unique_consecutive",
    torch.bincount: "torch.bincount", _T.bincount: "Tensor.bincount",
    torch.linalg.cholesky: "torch.linalg.cholesky", torch.cholesky: "torch.cholesky",
    torch.linalg.inv: "torch.linalg.inv", torch.inverse: "torch.inverse", _T.inverse: "Tensor.inverse",
    torch.linalg.solve: "torch.linalg.solve", torch.linalg.eigh: "torch.linalg.eigh",
    torch.linalg.eigvalsh: "torch.linalg.eigvalsh", torch.linalg.lu_factor: "torch.linalg.lu_factor",
}
#: the ``_ex`` forms sync only with ``check_errors=True``
_CHECK_ERRORS = {torch.linalg.cholesky_ex: "torch.linalg.cholesky_ex", torch.linalg.inv_ex: "torch.linalg.inv_ex",
                 torch.linalg.solve_ex: "torch.linalg.solve_ex", torch.linalg.lu_factor_ex: "torch.linalg.lu_factor_ex"}


class HostSyncError(RuntimeError):
    """Raised by :class:`forbid_host_sync` when a host synchronisation happens inside its block."""


def _is_host(device: object) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _sync_reason(func, args, kwargs) -> str | None:
    """The name of the synchronising call ``func(*args, **kwargs)``, or ``None`` if it makes none."""
    name = _ALWAYS.get(func)
    if name is not None:
        return name
    if func in _CHECK_ERRORS:
        return f"{_CHECK_ERRORS[func]}(check_errors=True)" if kwargs.get("check_errors", False) else None
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave with tensor repeats and no output_size"
        if isinstance(args[0], torch.Tensor) and len(args) == 1 and not kwargs and func is torch.repeat_interleave:
            return "torch.repeat_interleave(repeats)"
        return None
    if func in (torch.tensor, torch.as_tensor, torch.asarray, _T.new_tensor):
        data = args[1] if func is _T.new_tensor else (args[0] if args else kwargs.get("data"))
        if not isinstance(data, torch.Tensor):  # on a GPU: a copy from pageable host memory (illegal in capture)
            return f"{resolve_name(func) or func.__name__} from Python data (a host-to-device copy on a GPU)"
        return None
    if func is _T.to:
        device = kwargs.get("device")
        for arg in args[1:]:
            if isinstance(arg, (str, torch.device)):
                device = arg
        return "Tensor.to('cpu')" if _is_host(device) else None
    if func is _T.__getitem__:
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
            return "indexing with a boolean tensor"
        return None
    return None


class forbid_host_sync(TorchFunctionMode):
    """Context manager: raise :class:`HostSyncError` on any host synchronisation (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0  # torch functions seen, so a test can check the block did run through torch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"host synchronisation inside a forbid_host_sync block: {reason}")
        return func(*args, **kwargs)
