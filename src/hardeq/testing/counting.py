r"""Count the ATen calls and the host reads of a block of code: what a GPU would launch, and where it would wait.

On a GPU every ATen operator that computes something is (at least) one kernel launch, and every operator that
brings a value back to Python is a device-to-host synchronisation: the host waits until the device has finished
everything queued before it. Neither shows on a CPU's clock, so a test cannot see them there by timing;
:class:`count_calls` counts them instead, on any device, as a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
(it sees what autograd, ``torch.no_grad`` and the library's own code dispatch, including the backward pass).

* **ATen calls** (:attr:`CallCount.calls`): every operator dispatched inside the block except views (``view``,
  ``expand``, ``transpose``, ``select``, ``slice``, ``unsqueeze``, ``as_strided``, ... -- the operators tagged
  ``view``/aliasing, which launch nothing), allocations (``empty``, ``empty_like``, ``empty_strided``,
  ``new_empty`` ...) and metadata queries (``sym_size``, ``is_same_size`` ...). Host reads count here too.
* **host reads** (:attr:`CallCount.host_reads`): ``_local_scalar_dense`` (what ``item()``, ``float()``, ``int()``
  and ``tolist()`` call), ``is_nonzero`` (``bool(tensor)``), ``equal``, ``nonzero``, ``unique`` (every variant)
  and ``masked_select``; each reads a value, or a value-dependent size, from the device. Indexing with a boolean
  mask and ``repeat_interleave`` with tensor repeats and no ``output_size`` count too (their kernels call
  ``nonzero`` / read a size below the dispatcher, where the mode cannot see it), and so do ``tolist`` and
  ``numpy`` of a CPU tensor (which dispatch nothing there; on a GPU they copy to the host).

Use it to check a training step of your own::

    from hardeq.testing import count_calls

    with count_calls() as count:
        z = dist.rsample()
        loss = (z - target).square().sum()
        loss.backward()
    assert count.host_reads == 0, count.host_read_names    # nothing in the step waits for the device
    print(count.calls, count.by_name.most_common(5))        # launches, and the most frequent operators

Cost: one Python call per ATen operator (microseconds each); for measuring, not for production code.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ALLOCATIONS", "CallCount", "HOST_READS", "count_calls"]

#: operators that read a value (or a size that depends on values) from the device into the host
HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "unique",
                        "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                        "masked_select"})
#: allocating operators that compute nothing (no kernel beyond the allocator's)
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                         "empty_permuted", "resize_", "lift_fresh"})
#: metadata queries (answered on the host from the tensor's sizes, no launch)
_METADATA = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "size",
                       "stride", "dim", "numel", "is_contiguous", "_has_compatible_shallow_copy_type"})


def _is_view(func: Any) -> bool:
    """Whether an ATen overload is a view or an alias of its input (no computation, no launch)."""
    if torch.Tag.view_copy in getattr(func, "tags", ()):
        return False
    schema = func._schema
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return True  # (an out= or in-place operator returns its argument as a written alias: it computes)
    return False


def _reads_sizes(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """Operators whose kernel calls ``nonzero`` or reads a size on the host below the dispatcher: indexing with a
    boolean mask, ``repeat_interleave`` with tensor repeats and no ``output_size``."""
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu"  # a copy to the host
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


@dataclass
class CallCount:
    """What :class:`count_calls` saw: ``calls`` (ATen calls, host reads included), ``host_reads``, and the counts
    by operator name (``by_name``) and of the host reads (``host_read_names``).

    Example:
        >>> x = torch.ones(3)
        >>> with count_calls() as count:
        ...     y = (2 * x).sum()
        ...     value = y.item()
        >>> count.calls, count.host_reads, dict(count.host_read_names)
        (3, 1, {'_local_scalar_dense': 1})
    """

    calls: int = 0
    host_reads: int = 0
    by_name: Counter[str] = field(default_factory=Counter)
    host_read_names: Counter[str] = field(default_factory=Counter)

    def __str__(self) -> str:
        return f"{self.calls} ATen calls, {self.host_reads} host reads"


#: Python-level reads that bypass the dispatcher on a CPU tensor (on a GPU they dispatch a copy to the host)
_FUNCTION_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}


class _FunctionReads(TorchFunctionMode):
    """The host reads of :data:`_FUNCTION_READS`, counted into ``count`` (a CPU tensor's ``tolist`` dispatches
    nothing)."""

    def __init__(self, count: CallCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _FUNCTION_READS.get(func)
        if name is not None and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            self.count.calls += 1
            self.count.host_reads += 1
            self.count.by_name[name] += 1
            self.count.host_read_names[name] += 1
        return func(*args, **(kwargs or {}))


class count_calls(TorchDispatchMode):
    """Context manager counting the ATen calls and host reads inside its block (see the module docstring).

    Entering it returns a :class:`CallCount` that fills in as the block runs. Views, allocations and metadata
    queries are not counted. Nested modes (e.g. a ``FakeTensorMode``) see the same operators.

    Example:
        >>> x = torch.randn(4, 3)
        >>> with count_calls() as count:
        ...     y = x.t().unsqueeze(0)          # views: not counted
        ...     z = torch.mm(y[0], x).relu()   # two computing calls, no host read
        >>> count.calls, count.host_reads, count.by_name["mm"]
        (2, 0, 1)
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # (torch: unannotated)
        self.count = CallCount()
        self._functions = _FunctionReads(self.count)

    def __enter__(self) -> CallCount:  # (returns the count, not the mode)
        super().__enter__()  # type: ignore[no-untyped-call]  # (torch: unannotated)
        self._functions.__enter__()  # type: ignore[no-untyped-call]  # (torch: unannotated)
        return self.count

    def __exit__(self, *exc: Any) -> None:
        self._functions.__exit__(*exc)  # type: ignore[no-untyped-call]  # (torch: unannotated)
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # (torch: unannotated)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in ALLOCATIONS and name not in _METADATA and not _is_view(func):
            self.count.calls += 1
            self.count.by_name[name] += 1
            if name in HOST_READS or _reads_sizes(name, args, kwargs or {}):
                self.count.host_reads += 1
                self.count.host_read_names[name] += 1
        return func(*args, **(kwargs or {}))
