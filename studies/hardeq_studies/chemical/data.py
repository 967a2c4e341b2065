r"""Data of the ``chemical`` study: the settings, and the three process data sets with their balances.

Three Aspen data sets (CSTR, a DME/DEE plant, a distillation train; ``hardeq_studies/data/chemical_process``) map
process inputs ``x`` to outputs ``y`` that satisfy linear balances :math:`B y = b - A x` exactly. As in the
KKT-hPINN reference code, every column is MaxAbs-scaled on the whole file, the constraint coefficients are
rescaled so that the balances hold exactly in scaled units, and the rows are split in file order 60/20/20.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["CONFIG_PATH", "ChemicalData", "load_config", "load_dataset"]

CONFIG_PATH = Path(__file__).resolve().parent / "config.json"


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """The study's settings (``config.json`` next to this module, or ``path``)."""
    return json.loads(Path(path or CONFIG_PATH).read_text())


@dataclass
class ChemicalData:
    r"""One data set, MaxAbs-scaled, with the balances in scaled units :math:`B_s y_s = b - A_s x_s`.

    Attributes:
        name: ``"cstr"``, ``"plant"`` or ``"distillation"``.
        x, y: scaled inputs ``(N, n_x)`` and outputs ``(N, n)``, float64, file order.
        B, A, b: scaled constraint ``B_s = B diag(s_y)`` ``(a, n)``, ``A_s = A diag(s_x)`` ``(a, n_x)``, ``b`` ``(a,)``.
        scale_x, scale_y: the MaxAbs scales (max |column| over the whole file).
        columns: header names.
        splits: ``{"train": slice, "val": slice, "test": slice}`` (file order).
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    B: np.ndarray
    A: np.ndarray
    b: np.ndarray
    scale_x: np.ndarray
    scale_y: np.ndarray
    columns: list[str]
    splits: dict[str, slice]

    def residual(self) -> np.ndarray:
        r""":math:`B_s y_s + A_s x_s - b` of the data, ``(N, a)`` (round-off: the balances hold exactly)."""
        return self.y @ self.B.T + self.x @ self.A.T - self.b

    def tensors(self, split: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """``{"x": (N_split, n_x), "y": (N_split, n)}`` of one split."""
        sl = self.splits[split]
        return {"x": torch.as_tensor(self.x[sl], dtype=dtype, device=device),
                "y": torch.as_tensor(self.y[sl], dtype=dtype, device=device)}


def load_dataset(name: str, config: Mapping[str, Any] | None = None) -> ChemicalData:
    """Load, scale and split data set ``name`` as the reference code does (see the module docstring)."""
    config = config or load_config()
    if name not in config["datasets"]:
        raise ValueError(f"unknown data set {name!r}; available: {sorted(config['datasets'])}.")
    spec = config["datasets"][name]
    res = resources.files("hardeq_studies").joinpath("data/chemical_process").joinpath(spec["file"])
    with res.open("r") as fh:
        header = fh.readline().strip().split(",")
        raw = np.loadtxt(fh, delimiter=",", dtype=np.float64)
    nx = int(spec["num_inputs"])
    scale = np.abs(raw).max(axis=0)  # sklearn's MaxAbsScaler fitted on the whole file
    scale[scale == 0] = 1.0
    scaled = raw / scale
    B = np.asarray(spec["B"], dtype=np.float64) * scale[nx:]
    A = np.asarray(spec["A"], dtype=np.float64) * scale[:nx]
    b = np.asarray(spec["b"], dtype=np.float64)
    N = raw.shape[0]
    f_train, f_val, f_test = config["split"]
    n_val, n_test = int(f_val * N), int(f_test * N)  # as the reference: train gets the remainder
    n_train = N - n_val - n_test
    splits = {"train": slice(0, n_train), "val": slice(n_train, n_train + n_val),
              "test": slice(n_train + n_val, N)}
    return ChemicalData(name, scaled[:, :nx], scaled[:, nx:], B, A, b, scale[:nx], scale[nx:], header, splits)
