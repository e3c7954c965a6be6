"""Dispatch by evidence: which kernel was measured fastest for a class of calls on a
class of device, shipped by the plugins as data.

A plugin package may hold ``evidence.json`` beside its kernels. Each entry names a
device class (``"cuda sm_90"``, see :func:`portattn._lib.device_class`), the call
measured (dtype, shape ``(batch, Hq, Hkv, Lq, Lk, D)``, mask kinds and extras joined by
``+`` or ``"none"``, ``"forward"`` or ``"training"``), the seconds each kernel took and
where and when that was measured; calls are compared by class (:func:`call_class`:
head dim band, decode or prefill, size band). The GPU check writes such entries from
its speed section (``bench/gpu/evidence.py``), so each GPU run can refresh them.

Dispatch asks :func:`evidence_choice` after this machine's tune file (its own times
win) and before the priorities and the kernels' deferrals
(:meth:`~portattn.kernel.Kernel.defers_to`): among the kernels that can run a call, the
one measured fastest for its class runs when it beat the kernel the rules pick by
more than :data:`MARGIN`. Entries of one class from several runs or shapes add up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._lib import device_class
from ._registry import kernel_entries
from ._tune import _features, _head_dim_band, band

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from .._inputs import AttentionInputs

__all__ = ["DECODE_MAX_QUERIES", "FILE", "FORMAT", "MARGIN", "Evidence", "call_class",
           "evidence_choice", "has_evidence", "parse", "shipped"]

FILE = "evidence.json"
FORMAT = 1
#: A measured kernel replaces the one the rules pick when it took at most this much
#: less time: the GPU check's repeats agree to about 1%, and a user should never be
#: more than 2% slower than the kernel measured fastest.
MARGIN = 0.02
#: Calls with at most this many queries are decode steps.
DECODE_MAX_QUERIES = 16

_FIELDS = ("device", "dtype", "shape", "mask", "mode")


def call_class(inputs: AttentionInputs) -> tuple[str, ...]:
    """``(device class, dtype, head dim band, mask kinds and extras, mode, shape, size
    band)`` of a call: the key its evidence is found under."""
    return _key(_device_class(inputs), inputs.dtype, inputs.head_dim,
                _features(inputs.mask_kinds, inputs.bias is not None,
                          inputs.softcap is not None),
                "training" if inputs.requires_grad else "forward", inputs.q_len, inputs.kv_len)


def _key(device: str, dtype: str, head_dim: int, mask: str, mode: str, q_len: int,
         kv_len: int) -> tuple[str, ...]:
    return (device, dtype, str(_head_dim_band(head_dim)), mask, mode,
            "decode" if q_len <= DECODE_MAX_QUERIES else "prefill", band(max(q_len, kv_len)))


def _device_class(inputs: AttentionInputs) -> str:
    if inputs.device == "cpu" or inputs.device_obj is None:
        return inputs.device
    return device_class(inputs.device_obj)


@dataclass(frozen=True)
class Evidence:
    """What one class of calls was measured at: ``seconds`` per kernel (summed over the
    entries of the class) and ``sources``, where and when each entry was measured
    (``"NVIDIA H200, 2026-12-04"``)."""

    key: tuple[str, ...]
    seconds: Mapping[str, float]
    sources: tuple[str, ...]

    def text(self, chosen: str, other: str) -> str:
        """How ``explain()`` names this evidence for choosing ``chosen`` over ``other``."""
        ratio = self.seconds[other] / self.seconds[chosen]
        _, dtype, dim, mask, mode, shape, size = self.key
        masked = "no mask" if mask == "none" else mask
        call = f"{dtype}, {masked}, {mode}, {shape}, head dim {dim}, {size} sequences"
        verdict = (f"{ratio:.2f}x faster than" if ratio >= 1
                   else f"within {MARGIN:.0%} of")
        return (f"measured on {'; '.join(self.sources)}: {chosen} {verdict} {other} for "
                f"{call} (`python -m portattn tune` measures this machine)")


def parse(data: Any, source: str) -> list[tuple[tuple[str, ...], dict[str, float], str]]:
    """The entries of one evidence file's contents, checked: ``(key, seconds, where)``.

    Raises:
        ValueError: not evidence of this :data:`FORMAT`, or an entry without one of the
            call class's fields, or a time that is not a number of seconds.
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        msg = f"{source}: format={data.get('format') if isinstance(data, dict) else None!r}"
        raise ValueError(msg)
    found = []
    for entry in data["entries"]:
        missing = [f for f in _FIELDS if f not in entry]
        if missing:
            msg = f"{source}: an entry has no {', '.join(missing)}"
            raise ValueError(msg)
        seconds = {str(k): v for k, v in dict(entry["seconds"]).items()}
        for name, value in seconds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                msg = f"{source}: seconds of {name!r} is {value!r}, not a number of seconds"
                raise ValueError(msg)
        *_, lq, lk, d = (int(n) for n in entry["shape"])  # (batch, Hq, Hkv, Lq, Lk, D)
        key = _key(str(entry["device"]), str(entry["dtype"]), d, str(entry["mask"]),
                   str(entry["mode"]), lq, lk)
        measured = dict(entry.get("measured", {}))
        where = ", ".join(str(measured[k]) for k in ("gpu", "date") if k in measured)
        found.append((key, seconds, where or source))
    return found


def combined(entries: Iterable[tuple[tuple[str, ...], dict[str, float], str]]
             ) -> dict[tuple[str, ...], Evidence]:
    """Entries by class; the times of a class's entries add up, for the kernels every
    one of them measured."""
    grouped: dict[tuple[str, ...], list[tuple[dict[str, float], str]]] = {}
    for key, seconds, where in entries:
        grouped.setdefault(key, []).append((seconds, where))
    table = {}
    for key, rows in grouped.items():
        names = set.intersection(*(set(seconds) for seconds, _ in rows))
        totals = {n: sum(seconds[n] for seconds, _ in rows) for n in sorted(names)}
        sources = tuple(dict.fromkeys(where for _, where in rows))
        table[key] = Evidence(key, totals, sources)
    return table


#: The table read, for which registry list and packages (``packages=None``: read it
#: again), and the kinds of device it has entries for.
_loaded: dict[str, Any] = {"kernels": None, "packages": None, "table": {}, "kinds": frozenset()}


def shipped() -> dict[tuple[str, ...], Evidence]:
    """The evidence of every installed kernel's package, read once per set of kernels."""
    return _current()["table"]


def _current() -> dict[str, Any]:
    """:data:`_loaded` for the registry list in use (dispatch asks on every call it has
    not remembered: a new registry list is the only thing looked at then)."""
    entries = kernel_entries()
    if entries is _loaded.get("kernels") and _loaded["packages"] is not None:
        return _loaded
    packages = tuple(sorted({type(e.kernel).__module__.partition(".")[0]
                             for e in entries if e.kernel is not None}))
    if packages != _loaded["packages"]:
        found = []
        for package in packages:
            found += _read(package)
        table = combined(found)
        _loaded.update(table=table, kinds=frozenset(key[0].partition(" ")[0] for key in table))
    _loaded.update(packages=packages, kernels=entries)
    return _loaded


def _read(package: str) -> list[tuple[tuple[str, ...], dict[str, float], str]]:
    import importlib.resources
    import warnings

    from ._tune import TuneWarning

    try:
        path = importlib.resources.files(package).joinpath(FILE)
    except (TypeError, ModuleNotFoundError):  # a module, not a package: no data beside it
        return []
    if not path.is_file():
        return []
    try:
        return parse(json.loads(path.read_text(encoding="utf-8")), f"{package}/{FILE}")
    except (OSError, ValueError, TypeError, KeyError) as e:
        warnings.warn(f"ignoring the evidence {package} ships: {e}", TuneWarning,
                      stacklevel=2)
        return []


def has_evidence(inputs: AttentionInputs) -> bool:
    """Whether any entry is for the call's kind of device (cheap: decides whether
    dispatch must ask every kernel)."""
    return inputs.device in _current()["kinds"]


def evidence_choice(inputs: AttentionInputs, runnable: Sequence[str],
                    default: str) -> tuple[str, str] | None:
    """The kernel among ``runnable`` to run calls of the class of ``inputs`` by the
    evidence, and a note for ``explain()`` naming it: the one measured fastest when it
    beat ``default`` (the kernel the rules pick) by more than :data:`MARGIN`, else
    ``default``. None without evidence that covers ``default`` and another runnable
    kernel."""
    evidence = shipped().get(call_class(inputs))
    if evidence is None or default not in evidence.seconds:
        return None
    seconds = evidence.seconds
    others = [n for n in runnable if n in seconds and n != default]
    if not others:
        return None
    fastest = min(others, key=seconds.__getitem__)
    if seconds[fastest] < (1 - MARGIN) * seconds[default]:
        return fastest, evidence.text(fastest, default)
    return default, evidence.text(default, fastest)
