"""What the project's plots share (matplotlib with the Agg backend, imported lazily): axes that count
tick whole numbers, and a figure saved as PNG bytes (the caller writes them where it was asked to)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no screen needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def count_ticks(count_ax: Any, tp_ax: Any, tp_sizes: Iterable[int]) -> None:
    """Whole-number ticks on an axis of counts (requests) and ticks at exactly the TP sizes plotted on a
    TP axis (an integer locator alone still ticks 0.95-1.05 on a flat line)."""
    from matplotlib.ticker import MaxNLocator

    count_ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    tp_ax.set_yticks(sorted(set(tp_sizes)))


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    pyplot().close(fig)
    return out.getvalue()
