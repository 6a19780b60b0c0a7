"""Plots: ``figure`` (one PNG, closed on errors too), ``plot_baselines``,
``finish_levels_axes``. matplotlib is the optional ``plots`` extra: ``pyplot`` raises
``PlotUnavailable`` (saying how to install it) when it is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

#: What a run without matplotlib says instead of drawing its plot.
NO_MATPLOTLIB = (
    "no plot: matplotlib is not installed; install the plots extra "
    "(pip install -e '.[plots]', or .venv/bin/pip install 'matplotlib>=3.8') and run again"
)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (the ``plots`` extra): the figures are written, not the plot."""


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed); ``PlotUnavailable`` when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(NO_MATPLOTLIB) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(path: Path, *args: Any, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(*args, **kwargs)`` as (figure, axes); written to ``path`` (PNG, 110 dpi,
    parent directories made) when the block ends without an error, closed either way."""
    plt = pyplot()
    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_baselines(
    ax: Any, baselines: Mapping[str, Any], lines: Iterable[tuple[str, str, str]]
) -> None:
    """A dashed line of GB/s against concurrency for each (kind, label, colour) of ``lines``:
    the rows of ``baselines[kind]``."""
    for kind, label, color in lines:
        rows = baselines[kind]
        xs = [b["concurrency"] for b in rows]
        ax.plot(xs, [b["gbps"] for b in rows], "--", color=color, label=label)


def finish_levels_axes(ax: Any, xlabel: str, levels: Sequence[int]) -> None:
    """Concurrency levels on x, GB/s on a log scale, and the legend (after every line)."""
    ax.set_xlabel(xlabel)
    ax.set_xticks(levels)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
