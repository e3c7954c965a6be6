"""The picture: time and peak memory against sequence length, one colour per kernel
and one line style (and marker) per array library.

Drawn with matplotlib's object API on a bare ``Figure`` (rendered by Agg when saved
as PNG), so the user's pyplot backend and global state are left alone.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

__all__ = ["MissingDependency", "plot"]


#: One marker and one line style per array library: a kernel keeps its colour on each.
_MARKERS = {"numpy": "o", "torch": "s", "jax": "^", "dask": "D", "cupy": "v",
            "array_api_strict": "x"}
_LINES = {"numpy": "-", "torch": "--", "jax": "-.", "dask": ":", "cupy": (0, (5, 1)),
          "array_api_strict": (0, (1, 1))}


WARNING_COLOUR = "#c0392b"


class MissingDependency(ImportError):
    """An optional dependency of ``portattn bench`` is not installed."""


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        msg = ("the plot needs matplotlib, which is not installed; "
               "install it with `pip install matplotlib` (or pass --no-plot)")
        raise MissingDependency(msg) from e
    return Figure


def _label(key: tuple[str, str, str], dtypes: set[str]) -> str:
    runner, backend, dtype = key
    label = f"{runner} [{backend}]"
    if runner == "numpy_sgemm":
        label = "numpy float32 GEMM, same FLOPs (reference)"
    return f"{label} {dtype}" if len(dtypes) > 1 else label


def plot(rows: list[dict[str, Any]], path: Path, title: str,
         warnings: Sequence[str] = ()) -> Path:
    """Write a PNG (log-log time vs L and memory vs L per mask); returns ``path``.

    ``warnings`` (the report's, about the timings) are written under the panels, and
    the times they are about (:func:`~portattn_bench.report.unreliable`) are ringed.
    """
    figure = _figure_class()
    from matplotlib.ticker import NullLocator
    ok = [r for r in rows if r["status"] == "ok"]
    masks = [m for m in ("none", "causal") if any(r["mask"] == m for r in ok)] or ["none"]
    dtypes = {r["dtype"] for r in ok}
    series: dict[tuple[str, str, str], dict[str, list[dict]]] = {}
    for r in sorted(ok, key=lambda r: r["q_len"]):
        series.setdefault((r["runner"], r["backend"], r["dtype"]), {}).setdefault(
            r["mask"], []).append(r)

    fig = figure(figsize=(5.5 * len(masks) + 3, 8.5), layout="constrained")
    axes = fig.subplots(2, len(masks), squeeze=False, sharex=True)
    runners = sorted({key[0] for key in series})
    colours = dict(zip(runners, _colours(len(runners)), strict=True))
    for key, by_mask in sorted(series.items()):
        kind = by_mask[next(iter(by_mask))][0]["kind"]
        library = key[1].removesuffix("_cuda")
        style = {"color": "black" if kind == "reference" else colours[key[0]],
                 "marker": _MARKERS.get(library, "o"), "markersize": 4,
                 "linestyle": ":" if kind == "reference" else _LINES.get(library, "-"),
                 "label": _label(key, dtypes)}
        for col, mask in enumerate(masks):
            points = by_mask.get(mask, [])
            if not points:
                continue
            lengths = [p["q_len"] for p in points]
            axes[0][col].plot(lengths, [p["best_s"] for p in points], **style)
            mem = [(p["q_len"], p["memory_bytes"] / 2**20) for p in points
                   if p["memory_bytes"]]
            if mem and kind != "reference":  # a GEMM's memory says nothing of attention
                axes[1][col].plot(*zip(*mem, strict=True), **style)
    if warnings:
        _ring_unreliable(axes[0], masks, ok)
    methods = ", ".join(sorted({r["memory_method"] for r in ok if r["memory_method"]})) or "-"
    for col, mask in enumerate(masks):
        top, bottom = axes[0][col], axes[1][col]
        top.set_title(f"mask={mask}")
        top.set_ylabel("time per call (s, best)")
        bottom.set_ylabel(f"peak memory (MiB; {methods})")
        bottom.set_xlabel("sequence length L (Lq = Lk)")
        lengths = sorted({r["q_len"] for r in ok})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.suptitle(title, fontsize="medium")
    if warnings:
        fig.supxlabel("\n".join(textwrap.fill(w, 140) for w in warnings), color=WARNING_COLOUR,
                      fontsize="small", horizontalalignment="left", x=0.01)
    fig.savefig(path, dpi=110)
    return path


def _ring_unreliable(time_axes: Any, masks: list[str], rows: list[dict[str, Any]]) -> None:
    """A red ring around each time the warnings are about, labelled once."""
    from .report import unreliable

    label = "unreliable time (see the warning below)"
    for row in unreliable(rows):
        if row["mask"] in masks:
            time_axes[masks.index(row["mask"])].plot(
                row["q_len"], row["best_s"], linestyle="none", marker="o", markersize=11,
                markerfacecolor="none", markeredgecolor=WARNING_COLOUR, markeredgewidth=1.5,
                label=label, zorder=5)
            label = "_unreliable"  # matplotlib leaves labels starting with _ out


def _colours(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(n)]
