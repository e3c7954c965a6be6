"""Running the planned cases: inputs, skips predicted from smaller sizes, a progress bar.

Cases of one series (same runner, backend, dtype and mask) run in order of length, so
each size can be predicted from the last one: attention time grows about as L^2, memory
as L^1..L^2 (fitted from the last two sizes). A case predicted to exceed the time or
memory limit is skipped with the prediction as its reason instead of hanging the
machine; a series that failed (say, out of memory) skips its larger sizes.
"""

from __future__ import annotations

import gc
import statistics
import sys
from typing import TYPE_CHECKING, Any

from .measure import measure

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from .cases import Case, Plan, SweepConfig

__all__ = ["History", "Inputs", "fmt_bytes", "record", "release", "run"]

BENCH_EXTRA = "pip install tqdm"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class History:
    """What each series measured so far, to predict (and skip) larger sizes."""

    def __init__(self, config: SweepConfig) -> None:
        self.config = config
        self.points: dict[tuple, list[tuple[int, float, int | None]]] = {}
        self.failed: dict[tuple, int] = {}

    def add(self, case: Case, seconds: float, memory: int | None) -> None:
        self.points.setdefault(case.series, []).append((case.length, seconds, memory))

    def fail(self, case: Case) -> None:
        self.failed.setdefault(case.series, case.length)

    def skip_reason(self, case: Case) -> str | None:
        if case.series in self.failed:
            return f"failed at L={self.failed[case.series]}"
        points = self.points.get(case.series)
        if not points:
            return None
        length, seconds, memory = points[-1]
        growth = case.length / length
        predicted = seconds * growth**2
        if predicted > self.config.max_time:
            return (f"predicted {predicted:.3g} s per call > max time "
                    f"{self.config.max_time:g} s")
        limit = self.config.max_memory
        if memory and limit is not None:
            exponent = 2.0
            if len(points) > 1 and points[-2][2]:
                l0, _, m0 = points[-2]
                ratio = max(memory / m0, 1.0)
                exponent = min(2.0, max(1.0, _log(ratio) / _log(length / l0)))
            need = memory * growth**exponent
            if need > limit:
                return f"predicted peak memory {fmt_bytes(need)} > limit {fmt_bytes(limit)}"
        return None


def _log(x: float) -> float:
    import math

    return math.log(x) if x > 0 else 0.0


def record(case: Case, status: str, reason: str | None = None,
           times: list[float] | None = None, memory: int | None = None,
           memory_method: str | None = None) -> dict[str, Any]:
    """One JSON-ready result row."""
    s = case.shape
    row: dict[str, Any] = {
        "runner": case.runner.name, "kind": case.runner.kind,
        "provenance": case.runner.provenance, "backend": str(case.backend),
        "device": case.backend.device, "dtype": case.dtype, "mask": case.mask,
        "batch": s.batch, "heads": s.heads, "q_len": case.length, "kv_len": case.length,
        "head_dim": s.head_dim, "value_head_dim": s.value_head_dim, "flops": case.flops,
        "status": status, "reason": reason, "times_s": times or [],
        "best_s": None, "median_s": None, "gflops": None,
        "memory_bytes": memory, "memory_method": memory_method,
    }
    if times:
        row["best_s"] = min(times)
        row["median_s"] = statistics.median(times)
        row["gflops"] = case.flops / row["best_s"] / 1e9
    return row


class Inputs:
    """Inputs for the current length, converted once per (backend, dtype)."""

    def __init__(self) -> None:
        self.length = -1
        self.host: tuple[Any, Any, Any] | None = None
        self.converted: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def get(self, case: Case) -> tuple[Any, Any, Any]:
        if case.length != self.length:
            self.clear()
            self.length = case.length
            self.host = case.shape.arrays(case.length)
        key = (str(case.backend), case.dtype)
        if key not in self.converted:
            host = self.host or ()
            self.converted[key] = tuple(case.backend.asarray(a, case.dtype) for a in host)
        return self.converted[key]

    def clear(self) -> None:
        self.host, self.converted = None, {}
        release()


def release() -> None:
    """Return freed memory before the next case (CUDA caching allocators included)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run(config: SweepConfig, plan: Plan, *, progress: bool = True) -> tuple[list[dict], bool]:
    """Run every planned case; ``(results, interrupted)``. Ctrl-C keeps what was done."""
    history = History(config)
    inputs = Inputs()
    results: list[dict[str, Any]] = []
    try:
        for case in _progress(plan.cases, progress):
            results.append(_one(config, case, history, inputs))
    except KeyboardInterrupt:
        return results, True
    finally:
        inputs.clear()
    return results, False


def _one(config: SweepConfig, case: Case, history: History, inputs: Inputs) -> dict:
    skip = history.skip_reason(case)
    if skip is not None:
        return record(case, "skipped", skip)
    try:
        q, k, v = inputs.get(case)
        why = case.runner.reasons(case.backend, q, k, v, case.causal)
        if why:
            return record(case, "unsupported", "; ".join(why))
        call = case.runner.prepare(case.backend, q, k, v, case.causal)
        m = measure(call, case.backend.wait, repeat=config.repeat, warmup=config.warmup,
                    budget=config.budget, max_time=config.max_time,
                    memory=case.backend.memory,
                    first_of_series=case.series not in history.points,
                    settle=case.runner.settle, min_time=case.runner.min_time)
    except Exception as e:
        history.fail(case)
        release()
        return record(case, "error", f"{type(e).__name__}: {_first_line(e)}")
    history.add(case, min(m.times), m.memory)
    return record(case, "ok", None, m.times, m.memory, m.memory_method)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _progress(cases: list[Case], enabled: bool) -> Iterable[Case]:
    if not enabled:
        return cases
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"progress bar off: tqdm is not installed ({BENCH_EXTRA})", file=sys.stderr)
        return cases
    return _labelled(tqdm(cases, unit="case", dynamic_ncols=True, file=sys.stderr,
                          disable=None))


def _labelled(bar: Any) -> Iterator[Case]:
    for case in bar:
        bar.set_postfix_str(str(case), refresh=False)
        yield case
