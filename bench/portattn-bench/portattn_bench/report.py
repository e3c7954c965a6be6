"""Turning result rows into ratios, a terminal table and a JSON file."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .runners import SDPA_BASELINE, SGEMM
from .sweep import fmt_bytes

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["SCHEMA", "add_ratios", "busy_warning", "fmt_time", "reference_warning", "table",
           "timing_warnings", "unreliable", "write_json"]

SCHEMA = "portattn-bench/1"
_SHOWN = ("ok", "skipped", "error")
"""Statuses that get a table row ("unsupported" cases are only in the JSON)."""


def _group(row: dict[str, Any]) -> tuple:
    """Rows comparable with each other: same device, dtype, mask and length."""
    return (row["device"], row["dtype"], row["mask"], row["q_len"])


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``ratio_fastest`` and ``ratio_sdpa`` (time over the fastest attention / over torch
    SDPA) and ``ratio_sgemm`` (GFLOP/s over the machine's sgemm rate at that size).

    The sgemm reference computes no attention, so it is never "the fastest"."""
    fastest: dict[tuple, float] = {}
    sdpa: dict[tuple, float] = {}
    sgemm: dict[tuple, float] = {}
    for row in rows:
        if row["best_s"] is None:
            continue
        key = _group(row)
        if row["runner"] == SGEMM.name:
            sgemm[key] = row["gflops"]
            continue
        fastest[key] = min(fastest.get(key, row["best_s"]), row["best_s"])
        if row["runner"] == SDPA_BASELINE:
            sdpa[key] = row["best_s"]
    for row in rows:
        key, best = _group(row), row["best_s"]
        measured = best is not None
        attends = measured and row["runner"] != SGEMM.name
        row["ratio_fastest"] = best / fastest[key] if attends and key in fastest else None
        row["ratio_sdpa"] = best / sdpa[key] if attends and key in sdpa else None
        row["ratio_sgemm"] = row["gflops"] / sgemm[key] if measured and key in sgemm else None



def fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale or unit == "us":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return ""  # pragma: no cover


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def _percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _memory(row: dict[str, Any]) -> str:
    if row["memory_bytes"] is None:
        return "-"
    return f"{fmt_bytes(row['memory_bytes'])} ({row['memory_method']})"


_COLUMNS = ("L", "kernel", "backend", "best", "median", "GFLOP/s", "of sgemm",
            "vs fastest", "vs sdpa", "peak memory")
_MARKS = {"baseline": "*", "reference": "+"}


def _cells(row: dict[str, Any]) -> list[str]:
    name = row["runner"] + _MARKS.get(row["kind"], "")
    head = [str(row["q_len"]), name, row["backend"]]
    if row["status"] != "ok":
        return [*head, f"{row['status']}: {row['reason']}"]
    return [*head, fmt_time(row["best_s"]), fmt_time(row["median_s"]), f"{row['gflops']:.1f}",
            _percent(row["ratio_sgemm"]), _ratio(row["ratio_fastest"]),
            _ratio(row["ratio_sdpa"]), _memory(row)]


def table(rows: list[dict[str, Any]], shape: dict[str, int]) -> str:
    """Sections per (device, dtype, mask); rows by length, then time."""
    sections: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["status"] in _SHOWN:
            sections[row["device"], row["dtype"], row["mask"]].append(row)
    dims = ", ".join(f"{k}={v}" for k, v in shape.items())
    out: list[str] = []
    for (device, dtype, mask), section in sorted(sections.items()):
        section.sort(key=lambda r: (r["q_len"], r["best_s"] is None, r["best_s"] or 0.0,
                                    r["runner"]))
        cells = [_cells(r) for r in section]
        # A skip/error reason spans the timing columns, so it does not size them.
        sized = [list(_COLUMNS), *(c if len(c) == len(_COLUMNS) else c[:-1] for c in cells)]
        widths = [max(len(c[i]) for c in sized if len(c) > i) for i in range(len(_COLUMNS))]
        out.append(f"device={device} dtype={dtype} mask={mask} ({dims})")
        out.append(_line(list(_COLUMNS), widths))
        previous = None
        for row, c in zip(section, cells, strict=True):
            if previous is not None and row["q_len"] != previous:
                out.append("")
            previous = row["q_len"]
            out.append(_line(c, widths))
        out.append("")
    if any(r["kind"] == "baseline" for r in rows):
        out.append("* baseline, not a portattn kernel")
    if any(r["kind"] == "reference" for r in rows):
        out.append("+ reference: NumPy's float32 GEMM on square matrices with the "
                   "case's FLOPs; 'of sgemm' is GFLOP/s as a share of its rate")
    return "\n".join(out).rstrip() + "\n"


BUSY_SPREAD = 2.0
"""Median over best beyond this: the machine was busy while it measured."""


def busy_warning(rows: list[dict[str, Any]]) -> str | None:
    """A warning when the spread of the timings says other work shared the machine
    (their ratios are then unreliable), naming the worst row; else None."""
    spread = [(_spread(r), r) for r in rows if _spread(r) is not None]
    if not spread:
        return None
    worst, row = max(spread, key=lambda item: item[0])
    if worst <= BUSY_SPREAD:
        return None
    return (f"warning: the machine looks busy: median/best up to {worst:.1f}x "
            f"({row['runner']} [{row['backend']}] at L={row['q_len']}); timings and "
            "their ratios are unreliable, run again on an idle machine")


def _spread(row: dict[str, Any]) -> float | None:
    if not (row.get("best_s") and row.get("median_s")):
        return None
    return row["median_s"] / row["best_s"]


SLOWED = 0.9
"""An sgemm at a larger L this much faster than at a smaller one was slowed there (a
margin for noise between sizes close together)."""


def _slowed_references(rows: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """``(slow, fast)`` pairs of sgemm rows of one device, dtype and mask where the
    longer call (``fast``, larger L, more FLOPs) took less time than ``slow``: the GEMM
    was slowed by other work at ``slow``'s size. Sorted by how much, worst first."""
    series: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["runner"] == SGEMM.name and row.get("best_s"):
            series[row.get("device"), row["dtype"], row["mask"]].append(row)
    pairs = []
    for points in series.values():
        points.sort(key=lambda r: r["q_len"])
        for i, slow in enumerate(points):
            fastest = min(points[i + 1:], key=lambda r: r["best_s"], default=None)
            if fastest is not None and fastest["best_s"] < SLOWED * slow["best_s"]:
                pairs.append((slow, fastest))
    return sorted(pairs, key=lambda p: p[1]["best_s"] / p[0]["best_s"])


def reference_warning(rows: list[dict[str, Any]]) -> str | None:
    """A warning when the sgemm reference took less time at a larger size than at a
    smaller one (naming the worst such pair), else None."""
    pairs = _slowed_references(rows)
    if not pairs:
        return None
    slow, fast = pairs[0]
    return (f"warning: the sgemm reference took {fmt_time(slow['best_s'])} at "
            f"L={slow['q_len']} but {fmt_time(fast['best_s'])} at L={fast['q_len']} "
            f"(mask={slow['mask']}): more work in less time, so other work slowed it at "
            f"L={slow['q_len']}, where the 'of sgemm' shares are too high; run again on an "
            "idle machine")


def timing_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """Every warning about the timings: a busy machine, a slowed reference."""
    return [w for w in (busy_warning(rows), reference_warning(rows)) if w is not None]


def unreliable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the warnings are about: timings spread over more than
    :data:`BUSY_SPREAD`, and sgemm references slowed by other work."""
    slowed = {id(slow) for slow, _ in _slowed_references(rows)}
    return [r for r in rows if id(r) in slowed or (_spread(r) or 0.0) > BUSY_SPREAD]


def _line(cells: list[str], widths: list[int]) -> str:
    numeric = {0, 3, 4, 5, 6, 7, 8}
    parts = []
    for i, cell in enumerate(cells):
        if i == len(cells) - 1 and len(cells) < len(widths):
            parts.append(cell)  # a skip/error reason spans the remaining columns
        else:
            parts.append(cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]))
    return "  ".join(parts).rstrip()


def write_json(path: Path, payload: dict[str, Any]) -> None:
    payload = {"schema": SCHEMA, **payload}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
