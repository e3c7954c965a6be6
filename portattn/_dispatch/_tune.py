"""Dispatch by measurement: the tune file and the table dispatch reads.

``python -m portattn tune`` (``_tune_run``) times every kernel that can run a set of
representative calls (per library, dtype, head dim, mask kind and size band) on this
machine and writes the times to a small per-user file, with the machine and the
versions of everything measured. Dispatch asks :func:`measured_choice` which of the
kernels that can run a call was measured fastest for that call's band; without a
usable file the declared priorities stand. The file also holds the value of each
kernel's ``tunables`` timed fastest, which kernels read through ``Kernel.tuned``.

A file from another machine (``foreign``), from other versions of the measured
distributions or missing a kernel distribution installed since (``stale``) is ignored
with a :class:`TuneWarning`: its times say nothing about this installation. The
file's location: ``$PORTATTN_TUNE_FILE``, else
``$XDG_CACHE_HOME/portattn/tune-<environment>.json`` (``~/.cache`` when unset;
``%LOCALAPPDATA%`` on Windows), one file per Python environment (``sys.prefix``): each
virtualenv has its own versions to measure. ``PORTATTN_TUNE_FILE=""`` turns measured
dispatch off.

No array library is imported here (nor by ``_tune_run``, until it times one).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import stat
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._lib import install_tuned_reader
from ._registry import kernel_entries

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._inputs import AttentionInputs

__all__ = ["TUNE_ENV", "TuneWarning", "band", "call_key", "default_path", "environment_id",
           "installed_version", "machine", "measured_choice", "refresh", "table_in_use",
           "tuned"]

TUNE_ENV = "PORTATTN_TUNE_FILE"
FORMAT = 1
#: Sequence lengths that stand for each size band (``band`` maps a call to one).
BAND_SIZES = {"short": 256, "medium": 1024, "long": 4096}
_BAND_LIMITS = (("short", 512), ("medium", 2048))
#: How often (seconds) dispatch looks whether the file changed.
RECHECK_S = 1.0
#: A kernel replaces the one the priorities pick only when measured at least this much
#: faster: smaller differences are noise on a shared machine (a 7% "win" of a quick
#: run made calls 4.5x slower at other shapes).
MARGIN = 0.1
#: A measurement steers calls with up to this many times more (or fewer) batch x head
#: rows than it had: beyond that the fastest kernel may change.
SPREAD = 8


class TuneWarning(UserWarning):
    """A tune file that is ignored: unreadable, from another machine, or stale."""


def default_path() -> Path | None:
    """Where the tune file lives (None when ``PORTATTN_TUNE_FILE`` is set empty)."""
    given = os.environ.get(TUNE_ENV)
    if given is not None:
        return Path(given).expanduser() if given.strip() else None
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        root = Path(os.environ["LOCALAPPDATA"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "portattn" / f"tune-{environment_id()}.json"


def environment_id() -> str:
    """A short name of this Python environment (from ``sys.prefix``)."""
    import hashlib

    return hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]


# -- keys: which representative call a real call is compared with ------------------

def band(length: int) -> str:
    """The size band of a sequence length (the longer of query and key)."""
    for name, limit in _BAND_LIMITS:
        if length <= limit:
            return name
    return "long"


def _head_dim_band(head_dim: int) -> int:
    """Head dims are compared by the power of two at or above them (64 stands for 33-64)."""
    return 1 << max(0, head_dim - 1).bit_length()


def _features(mask_kinds: Any, bias: bool, softcap: bool) -> str:
    parts = sorted(mask_kinds) + (["bias"] if bias else []) + (["softcap"] if softcap else [])
    return "+".join(parts) or "none"


_call_parts: dict[tuple, tuple[str, str, str, int, str]] = {}


def call_key(inputs: AttentionInputs) -> tuple[str, str, str, int, str, str, str]:
    """``(library, device, dtype, head dim band, mask kinds and extras, size band,
    mode)``; the mode is ``training`` for calls that need gradients, else ``forward``."""
    # dispatch asks on every call it has not seen: the parts that need work are remembered
    seen = (inputs.namespace, inputs.device, inputs.dtype, inputs.head_dim, inputs.mask_kinds,
            inputs.bias is not None, inputs.softcap is not None)
    parts = _call_parts.get(seen)
    if parts is None:
        if len(_call_parts) > 1024:
            _call_parts.clear()
        parts = _call_parts[seen] = (*seen[:3], _head_dim_band(seen[3]), _features(*seen[4:]))
    return (*parts, band(max(inputs.q_len, inputs.kv_len)),
            "training" if inputs.requires_grad else "forward")


def _key_of(row: dict[str, Any]) -> tuple[str, str, str, int, str, str, str]:
    # files written before training was timed hold forward calls only
    return (row["library"], row["device"], row["dtype"], _head_dim_band(row["head_dim"]),
            row["mask"], row["band"], row.get("mode", "forward"))


# -- the file: machine, versions, loading -------------------------------------------

#: Environment variables that choose which CPU kernels a library runs: OpenBLAS's
#: (its AVX2 and AVX-512 sgemm differed 1.8-1.9x on one Zen 5 core), MKL's, torch's and
#: NumPy's. Times measured under other values do not hold.
KERNEL_ENVIRONMENT = ("OPENBLAS_CORETYPE", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
                      "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES")


def machine() -> dict[str, Any]:
    """What identifies this machine for timing purposes: with any
    :data:`KERNEL_ENVIRONMENT` variable that is set."""
    found = {"system": platform.system(), "arch": platform.machine(), "cpu": _cpu_model(),
             "cpus": _usable_cpus()}
    chosen = {name: os.environ[name] for name in KERNEL_ENVIRONMENT if name in os.environ}
    if chosen:  # absent when none is set, as in files written before it was recorded
        found["kernel_environment"] = chosen
    return found


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class _Table:
    """A loaded tune file: kernels ranked fastest first, per call key."""

    date: str
    ranked: dict[tuple, tuple[str, ...]]
    times: dict[tuple, dict[str, float]]
    rows: dict[tuple, int | None]
    """Batch x head rows of each measured call (None for a file that did not say)."""
    settings: dict[str, dict[str, Any]]
    """``kernel name -> setting -> value`` chosen by the run."""


def _read(path: Path) -> _Table | None:
    """The usable contents of ``path``, or None (with a warning saying why not)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the call forever
            msg = "not a regular file"
            raise ValueError(msg)
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            msg = f"format={data.get('format') if isinstance(data, dict) else None!r}"
            raise ValueError(msg)
        created, rows = str(data["created"]), list(data["entries"])
        recorded_machine, versions = dict(data["machine"]), dict(data["versions"])
        times = {_key_of(row): _times(row) for row in rows}
        ranked = {key: tuple(sorted(t, key=t.get)) for key, t in times.items()}
        measured_rows = {_key_of(row): _rows(row) for row in rows}
        settings = {str(kernel): {str(name): found["chosen"] for name, found in dict(
            chosen).items()} for kernel, chosen in dict(data.get("settings", {})).items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        _warn(f"ignoring tune file {path}: not a portattn tune file ({e})")
        return None
    here = machine()
    if recorded_machine != here:
        differ = ", ".join(f"{k}={recorded_machine.get(k)!r} here {here.get(k)!r}"
                           for k in sorted(set(here) | set(recorded_machine))
                           if recorded_machine.get(k) != here.get(k))
        _warn(f"ignoring tune file {path}: measured on another machine ({differ}); "
              "run `python -m portattn tune` here")
        return None
    changed = [f"{dist} {old} (now {installed_version(dist) or 'not installed'})"
               for dist, old in sorted(versions.items()) if installed_version(dist) != old]
    stale = [f"measured with {', '.join(changed)}"] if changed else []
    # A kernel installed since was never timed: it could be the fastest.
    newcomers = sorted({f"{e.distribution} {e.version}" for e in kernel_entries()
                        if e.distribution not in versions})
    if newcomers:
        stale.append(f"{', '.join(newcomers)} installed since")
    if stale:
        _warn(f"ignoring tune file {path}: stale, {'; '.join(stale)}; "
              "run `python -m portattn tune` again")
        return None
    return _Table(created[:10], ranked, times, measured_rows, settings)


def _times(row: dict[str, Any]) -> dict[str, float]:
    """A row's times, checked: finite numbers >= 0 seconds, by kernel name."""
    times = dict(row["times"])
    for name, seconds in times.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not math.isfinite(seconds) or seconds < 0:
            msg = f"time of {name!r} is {seconds!r}, not a number of seconds"
            raise ValueError(msg)
    return times


def _rows(row: dict[str, Any]) -> int | None:
    """Batch x head rows of a measured call (``shape`` is ``(batch, heads, L, D)``)."""
    shape = row.get("shape")
    return int(shape[0]) * int(shape[1]) if shape else None


def _warn(message: str) -> None:
    warnings.warn(message, TuneWarning, stacklevel=4)


_state: dict[str, Any] = {"path": None, "stamp": None, "table": None, "checked": -math.inf}


def refresh() -> None:
    """Forget the loaded tune file: the next call reads it again."""
    _state.update(path=None, stamp=None, table=None, checked=-math.inf)


def _stamp(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _table() -> _Table | None:
    """The current tune file's table; looks at the file at most every ``RECHECK_S``."""
    now = time.monotonic()
    if now - _state["checked"] < RECHECK_S:
        return _state["table"]
    _state["checked"] = now
    path = default_path()
    stamp = _stamp(path)
    if path != _state["path"] or stamp != _state["stamp"]:
        table = None if stamp is None or path is None else _read(path)
        _state.update(path=path, stamp=stamp, table=table)
    return _state["table"]


def table_in_use() -> Any:
    """The loaded tune table (None without one): a new object whenever the file
    changes, so what was decided with the old one can be told stale."""
    return _table()


def tuned() -> bool:
    """Whether a usable tune file is there (as cheap as :func:`measured_choice`): without
    one, dispatch may stop at the first kernel that can run a call."""
    return _table() is not None


def _settings_in_use() -> dict[str, dict[str, Any]]:
    table = _table()
    return {} if table is None else table.settings


install_tuned_reader(_settings_in_use)


def measured_choice(inputs: AttentionInputs, runnable: Sequence[str]) -> tuple[str, str] | None:
    """The kernel among ``runnable`` (in priority order) measured fastest for calls like
    ``inputs``, and a note for ``explain()``; None without a usable tune entry, when the
    call has far more or fewer rows than the measured one (:data:`SPREAD`), or when the
    fastest beat the first runnable by less than :data:`MARGIN` (priorities stand).
    Calls that need gradients are steered by the training calls measured (forward and
    gradients), the others by the forward ones.
    """
    table = _table()
    if table is None:
        return None
    key = call_key(inputs)
    ranked = table.ranked.get(key)
    fastest = next((name for name in ranked or () if name in runnable), None)
    if fastest is None:
        return None
    measured = table.rows[key]
    rows = math.prod(inputs.batch_shape) * inputs.num_heads
    if measured is not None and not measured / SPREAD <= rows <= measured * SPREAD:
        return None  # far from the measured shape
    times, default = table.times[key], runnable[0]
    if fastest != default and default in times and times[fastest] > (1 - MARGIN) * times[default]:
        return None  # within the noise of the kernel the priorities pick
    return fastest, f"measured fastest (tune of {table.date})"
