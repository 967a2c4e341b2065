"""One colour per method across every panel and every study, and small plotting conventions.

:func:`color` is the only place a study gets a method's colour from; :data:`COLORS` fixes the known methods
(estimators of the synthetic study, methods of the chemical study) and unknown names get a stable colour
from a hash. :func:`integer_epochs` puts integer ticks on an epoch axis; :func:`mark_off_scale` labels a
curve that lies outside the plotted range at the edge of the axes.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["COLORS", "color", "linestyle", "integer_epochs", "mark_off_scale"]

_TAB20 = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
          "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d",
          "#17becf", "#9edae5"]

#: method -> colour (hex). Distinct within each study; names shared by studies keep one colour.
COLORS: dict[str, str] = {
    # chemical: baselines
    "NN": "#7f7f7f", "PINN": "#8c564b", "KKT-hPINN": "#1f77b4", "ECNN": "#ff7f0e", "CL": "#2ca02c",
    "CL-coord": "#98df8a",
    # chemical: ours and its variants
    "ours": "#d62728", "ours-L1": "#e377c2", "ours-NLL": "#9467bd", "ours-sg": "#ff9896",
    "ours-NLL-sg": "#c5b0d5", "ours-NLL-sepnet": "#17becf", "ours-bNLL": "#bcbd22", "ours-NLL-homvar": "#000000",
    "ours-tNLL": "#c49c94",
    # synthetic: gradient estimators
    "pathwise": "#1f77b4", "marginal_expectation": "#d62728", "constrained_marginal": "#ff7f0e",
    "unconstrained_marginal": "#2ca02c", "constrained_layer": "#9467bd", "constrained_layer_independent": "#c5b0d5",
    "constrained_reparam_independent": "#8c564b", "cr-independent": "#8c564b", "cr_independent": "#8c564b",
    "constrained_reparam": "#17becf", "random": "#7f7f7f",
}


def color(method: str) -> str:
    """The colour of ``method`` (fixed for known names, a stable hash-chosen one otherwise)."""
    if method in COLORS:
        return COLORS[method]
    h = int.from_bytes(hashlib.sha256(method.encode()).digest()[:4], "little")
    return _TAB20[h % len(_TAB20)]


def linestyle(method: str) -> str:
    """Dashed for this library's methods (``ours*``), solid for the baselines."""
    return "--" if method.startswith("ours") else "-"


def integer_epochs(ax: Any) -> None:
    """Integer ticks on the x (epoch) axis, 1-based."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def mark_off_scale(ax: Any, label: str, above: bool, slot: int = 0) -> None:
    """Write ``label (off scale ↑/↓)`` at the top or bottom edge of ``ax`` in the method's colour, for a curve
    drawn outside the y-range; ``slot`` stacks several labels."""
    y = 0.97 - 0.06 * slot if above else 0.03 + 0.06 * slot
    ax.text(0.99, y, f"{label} (off scale {'↑' if above else '↓'})", transform=ax.transAxes, ha="right",
            va="top" if above else "bottom", fontsize=7, color=color(label))
