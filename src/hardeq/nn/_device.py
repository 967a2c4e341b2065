"""A module whose ``.to(...)`` / ``.cuda()`` say what to fix when a GPU is asked for on a machine without one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._validation import check_device

__all__ = ["DeviceCheckedModule"]


class DeviceCheckedModule(nn.Module):
    """``nn.Module`` whose :meth:`to` and :meth:`cuda` raise a ``ValueError`` naming ``device`` and the fix
    (``device='cpu'``, or a CUDA build of torch on a machine with a GPU) instead of torch's
    ``AssertionError: Torch not compiled with CUDA enabled``. Everything else is ``nn.Module``'s."""

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        check_device(device)
        return super().to(*args, **kwargs)

    def cuda(self, device: int | torch.device | None = None) -> Any:
        check_device("cuda" if device is None else torch.device("cuda", device) if isinstance(device, int) else device)
        return super().cuda(device)
