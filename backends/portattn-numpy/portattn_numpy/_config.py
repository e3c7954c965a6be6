"""The kernel's settings in one object: tile sizes, strategies, instrumentation.

``configured(**changes)`` changes some for a block (tests use it for tiny tiles, the
careful way alone, or a hook on every score tile); a call reads the settings once, when
it is planned, and every worker thread of that call sees the same ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["STRATEGIES", "Config", "configured", "current", "machine_tile_bytes"]

#: Every strategy, in the order they are tried (see ``_strategy``).
STRATEGIES = ("stacked", "diagonal", "tiles")
#: ``_exponential.ORDER``, without importing NumPy.
_EXPONENTIALS = ("exp2_compiled", "exp2", "exp_compiled", "exp")


@functools.cache
def machine_tile_bytes() -> int:
    """Twice one core's L2 cache, within [2 MiB, 8 MiB] (2 MiB when the machine does
    not say).

    Larger query blocks make fewer and wider products; the tile then lives in L2 and
    L3. Tiles past twice the L2 measured no faster on the machines tried.
    """
    l2 = _l2_bytes()
    return min(8 << 20, max(2 << 20, 2 * l2))


def _l2_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """One core's L2 cache in bytes, 0 when unknown."""
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (AttributeError, ValueError, OSError):
        size = 0
    if size > 0:
        return size
    # Linux without glibc's cache names (musl, some VMs): the kernel's own description
    for index in sorted(sysfs.glob("index*")):
        try:
            if (index / "level").read_text().strip() != "2":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        digits = text.rstrip("KMB")
        if digits.isdigit():
            return int(digits) * scale
    return 0


#: The settings that count something: positive integers.
_COUNTS = ("min_block_q", "preferred_block_q", "max_block_q", "max_block_k", "mask_step",
           "mask_chunk", "min_units_per_thread", "min_squares", "min_scores_per_thread")


@dataclass(frozen=True)
class Config:
    """How ``numpy_fast`` cuts and computes a call. The defaults are what ``bench/``
    measured fastest; the results do not depend on them."""

    tile_bytes: int | None = None
    """Bytes of one score tile; None: the size ``python -m portattn tune`` timed fastest
    on this machine, else :func:`machine_tile_bytes` (twice one core's L2)."""
    min_block_q: int = 16
    preferred_block_q: int = 1024
    """Query rows per tile where the keys fill the rest of it (a 2 MiB float32 tile:
    1024 x 512). Taller tiles than wide ones make half as many units, each with its
    fixed calls."""
    max_block_q: int = 2048
    """Query rows per tile at most. Queries fill the tile behind its key block, so short
    key ranges get tall tiles: the shorter the keys, the more a tile's fixed calls
    weigh against its products."""
    max_block_k: int = 1024
    """Keys per block at most (longer blocks measured no faster)."""
    mask_step: int = 128
    """Query rows per tile of the grid a mask's block form is read on (the steps of a
    staircase); also the diagonal's squares."""
    mask_chunk: int = 16
    """Keys per tile of the grid a mask's block form is read on. Narrow tiles keep a
    document's edge or a global token's column narrow: with 16 keys instead of 64,
    ``sliding_window(512) | global_tokens`` at L = 16384 computed 5.4% of the pairs
    instead of 6.1% and evaluated the mask's tiles over 23M pairs instead of 36M."""
    min_units_per_thread: int = 4
    min_squares: int = 4
    """Fewest diagonal squares in a unit: fewer and its fixed calls outweigh its work."""
    min_scores_per_thread: int = 1 << 18
    """Work a thread must get before handing it work pays, counted in scores
    (``_units.work``: key and value rows read count too)."""
    exponential: str | None = None
    """``"exp2_compiled"``, ``"exp_compiled"`` (both need Numba), ``"exp2"`` or
    ``"exp"``; None: the fastest here (``_exponential``). With a bias, scores stay in
    base e (changing the bias's base would cost a pass): an ``exp2`` gives way to the
    ``exp`` of its kind."""
    compiled_blocks: bool = True
    """Run the fast way's blocks without a mask in one compiled call where Numba and
    NumPy's BLAS allow it (``_compiled_blocks``); False: NumPy calls between them."""
    compiled_decode: bool = True
    """Run decode steps (at most ``_decode.DECODE_QUERIES`` queries, a mask of causal
    and window parts or none, no bias, score change or dropout) by the compiled paged
    loop, the cache read as one page per batch element (``_decode``), where Numba and
    NumPy's BLAS allow it; False: planned in tiles like any call. The ``on_tile`` and
    ``on_unit`` hooks ask for the plan too."""
    split_global_tokens: bool = True
    """Compute ``band | global_tokens(positions)`` (a sliding window or causal band
    joined to global tokens) in three exact parts merged by their log-sum-exps: the
    band, every row against the global keys outside its band, the global rows against
    every key (``_call``); False: through the union's block form, like any mask."""
    try_fast: bool = True
    """Try the unshifted exponential first (see ``_tiles``); False: the careful way only."""
    strategies: tuple[str, ...] = STRATEGIES
    """The strategies that may be used (``tiles`` always can)."""
    on_tile: Callable[..., Any] | None = field(default=None, compare=False)
    """Called as ``on_tile(batch_index, head, q0, q1, k0, k1)`` for every score tile."""
    on_unit: Callable[[str, bool], Any] | None = field(default=None, compare=False)
    """Called as ``on_unit(strategy, trusted)`` after a unit's fast way."""

    def __post_init__(self) -> None:
        bad = self._bad_setting()
        if bad is not None:
            raise ValueError(bad)
        # a tuple whatever sequence was given: plans are kept by the settings' hash
        object.__setattr__(self, "strategies", tuple(self.strategies))

    def _bad_setting(self) -> str | None:
        """What is wrong with the first bad setting, naming it and its value."""
        for name in (*_COUNTS, "tile_bytes"):
            value = getattr(self, name)
            if not ((value is None and name == "tile_bytes") or (
                    isinstance(value, numbers.Integral) and not isinstance(value, bool)
                    and value >= 1)):
                also = " or None" if name == "tile_bytes" else ""
                return f"{name} must be a positive integer{also}; got {name}={value!r}"
        for name in ("compiled_blocks", "compiled_decode", "split_global_tokens", "try_fast"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be True or False; got {name}={getattr(self, name)!r}"
        for name in ("on_tile", "on_unit"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                return f"{name} must be callable or None; got {name}={hook!r}"
        if self.exponential not in (None, *_EXPONENTIALS):
            names = ", ".join(map(repr, _EXPONENTIALS))
            return f"exponential must be {names} or None; got exponential={self.exponential!r}"
        if isinstance(self.strategies, str):
            return (f"strategies must be a sequence of names among {', '.join(STRATEGIES)}; "
                    f"got strategies={self.strategies!r}")
        unknown = sorted(set(self.strategies) - set(STRATEGIES))
        if unknown:
            return f"strategies must be among {', '.join(STRATEGIES)}; got strategies={unknown}"
        return None

    @property
    def mask_grid(self) -> tuple[int, int]:
        """``(rows, keys)`` of the tiles of the grid a mask's block form is read on."""
        return self.mask_step, self.mask_chunk

    def score_tile_bytes(self, tuned: Any = None) -> int:
        """Bytes of one score tile: :attr:`tile_bytes`, else ``tuned`` (the size ``python
        -m portattn tune`` timed fastest here, as the kernel reads it) where it is a
        positive integer, else :func:`machine_tile_bytes`."""
        if self.tile_bytes is not None:
            return self.tile_bytes
        if isinstance(tuned, int) and tuned > 0:
            return tuned
        return machine_tile_bytes()


_DEFAULT = Config()
_current: ContextVar[Config | None] = ContextVar("portattn_numpy_config", default=None)


def current() -> Config:
    """The settings the next call is planned with."""
    return _current.get() or _DEFAULT


@contextlib.contextmanager
def configured(**changes: Any) -> Iterator[Config]:
    """Within the block, calls use the current settings with ``changes`` (a
    ``ValueError`` names a bad one)."""
    try:
        changed = dataclasses.replace(current(), **changes)
    except TypeError as e:
        fields = ", ".join(f.name for f in dataclasses.fields(Config))
        msg = f"configured() takes the fields of Config ({fields}); got {sorted(changes)}"
        raise ValueError(msg) from e
    token = _current.set(changed)
    try:
        yield changed
    finally:
        _current.reset(token)
