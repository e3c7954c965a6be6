"""One call's mask, bias and score change, as the Triton kernels read them.

The kernels visit the tiles the mask's block form lists (``portattn.masks.block_mask``
on each kernel's own grid: hidden tiles never, full ones with no mask at all) and
mask a partial tile with formulas for the band (every causal and sliding-window part,
``mask.band``) and the key and query lengths, ANDed with a bit tile (:mod:`._bits`)
for the other parts, where those do not cover the tile. A :class:`MaskPlan` holds what
that needs for one call, and builds the tables and bit tiles of each grid once.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from . import _tables
from ._poison import cut_keys

if TYPE_CHECKING:
    from collections.abc import Callable

    from portattn.masks import Mask
    from portattn.scores import ScoreChange

    from ._distance import ByDistance

__all__ = ["Grid", "MaskPlan", "bias_view", "plan_for"]

#: Grids shared by the calls of one shape, so their tables and bit tiles stay on the
#: device instead of being built per call: those of masks with a content key
#: (``Mask.content_key``: none, causal, windows, sinks..., and small arrays by their
#: values: a model's layers calling with one batch's mask).
CACHE_SIZE = 64
_shared: OrderedDict[tuple, Any] = OrderedDict()
_shared_lock = threading.Lock()

#: Kinds the kernels mask with formulas; the others come as bit tiles.
FORMULA_KINDS = frozenset({"causal", "sliding_window", "key_lengths", "query_lengths"})
_ALIGNMENTS = ("bottom_right", "top_left")


@dataclass(eq=False)
class MaskPlan:
    """The mask (bound to the call, arrays in the caller's library ``xp`` on ``device``)
    and the bias of one call, with what the kernels read of them."""

    mask: Mask | None
    xp: Any
    device: Any
    to_torch: Callable[[Any], Any]
    torch_device: Any
    batch_shape: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    bias: Any = None
    """``(Z, Hq, Lq, Lk)`` torch view (stride 0 along broadcast axes), or None."""
    distance: ByDistance | None = None
    """A score change by distance (``_distance``), added where the bias is; it hides no
    pair, so the tiles and tables are those of the mask alone."""
    _grids: dict = field(default_factory=dict, repr=False)

    @cached_property
    def band(self) -> tuple[int | None, int | None]:
        """``(lower, upper)``: query row ``i`` may attend key ``j`` only when
        ``lower <= j - i <= upper`` (None: unbounded on that side)."""
        band = None if self.mask is None else self.mask.band(self.q_len, self.kv_len)
        if band is None:
            return None, None
        band = band.normalized(self.q_len, self.kv_len)
        return band.lower, band.upper

    @cached_property
    def key_lengths(self) -> Any:
        return self._lengths("key_lengths")

    @cached_property
    def query_lengths(self) -> Any:
        return self._lengths("query_lengths")

    def _lengths(self, kind: str) -> Any:
        """The tightest lengths of the ``kind`` parts, ``(Z,)`` int32 torch, or None."""
        import torch

        found = None
        for part in () if self.mask is None else self.mask.parts_of(kind):
            lengths = self.to_torch(part.lengths).reshape(-1).to(self.torch_device, torch.int32)
            found = lengths if found is None else torch.minimum(found, lengths)
        return found

    @cached_property
    def rest(self) -> Mask | None:
        """The parts masked by bit tiles (None when the formulas cover the mask)."""
        from portattn import masks

        return masks.intersection(
            masks.band_and_lengths(self.mask, self.q_len, self.kv_len).rest)

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def extra(self) -> str | None:
        """What the masked loop holds besides the formulas (``_configs.EXTRAS``): a
        score change by distance (with or without the others), a bias, bit tiles or
        nothing."""
        if self.distance is not None:
            return "distance"
        return "bias" if self.bias is not None else "bits" if self.rest is not None else None

    @property
    def needs_table(self) -> bool:
        """Whether the kernels read tables: not when the formulas cover the mask and
        there is no bias (the band then gives each block's tiles in the kernel, so its
        loops load nothing but the tiles)."""
        return self.rest is not None or self.bias is not None

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def cut(self) -> tuple[int, int] | None:
        """Keys a visited tile may hide from some row (see :func:`cut_keys`): with bit
        tiles or a bias (which may be ``-inf``), any key."""
        if self.rest is not None or self.bias is not None:
            return 0, self.kv_len
        return cut_keys(*self.band, self.q_len, self.kv_len)

    @cached_property
    def _rest_varies(self) -> tuple[int, int]:
        from ._bits import varies

        return varies(self.rest, self.xp, self.device, self.batch, self.num_heads,
                      self.q_len, self.kv_len)

    def states(self, block_q: int, block_k: int) -> tuple[Any, Any]:
        """``(states, rest states)`` of the grid, both ``(Z|1, H|1, R, C)`` with the
        same leading axes: the whole mask's, and those of the bit-tile parts (FULL
        everywhere without them)."""
        import numpy as np

        from portattn.masks import FULL, block_mask

        shape = (self.batch_shape, self.num_heads)
        whole = _tables.per_batch_and_head(
            block_mask(self.mask, self.q_len, self.kv_len, block_q, block_k).states, *shape)
        if self.rest is None:
            return whole, np.full((1, 1, *whole.shape[2:]), FULL, dtype=np.int8)
        rest = _tables.per_batch_and_head(
            block_mask(self.rest, self.q_len, self.kv_len, block_q, block_k).states, *shape)
        # allows may vary where the states cannot tell (values not readable): per its shape
        z, h = self._rest_varies
        rest = np.broadcast_to(rest, (max(rest.shape[0], z), max(rest.shape[1], h),
                                      *rest.shape[2:]))
        whole, rest = _tables.unify(whole, rest)
        return whole, rest

    def grid(self, block_q: int, block_k: int) -> Grid:
        """The tables and bit tiles of ``block_q x block_k`` tiles (built once)."""
        return self._remembered(("grid", block_q, block_k),
                                lambda: Grid(self, block_q, block_k))

    def _remembered(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, once per plan; across calls too where there is no bias and the
        mask has a content key (the same call shape then has the same tables and bit
        tiles)."""
        if key in self._grids:
            return self._grids[key]
        content = None if self.mask is None else self.mask.content_key()
        if self.bias is not None or (self.mask is not None and content is None):
            found = self._grids[key] = build()
            return found
        shared = (content, self.batch_shape, self.num_heads, self.num_kv_heads, self.q_len,
                  self.kv_len, str(self.torch_device), *key)
        with _shared_lock:
            found = _shared.get(shared)
            if found is not None:
                _shared.move_to_end(shared)
        if found is None:
            found = build()
            with _shared_lock:
                _shared[shared] = found
                while len(_shared) > CACHE_SIZE:
                    _shared.popitem(last=False)
        self._grids[key] = found
        return found

    def decode_tables(self, block_m: int, block_k: int, splits: int,
                      per_split: int) -> tuple[tuple[Any, ...], Any, bool]:
        """``(table arguments, bits, whether any tile has bits)`` of split-KV decode: one
        row per (batch element, K/V head, split), the query heads of each group merged
        (see ``_tables``)."""
        def build() -> tuple[tuple[Any, ...], Any, bool]:
            states, rest = self.states(self.q_len, block_k)
            group = self.group_size
            states = _tables.demote_ragged(_tables.group_states(states, group), self.q_len,
                                           self.kv_len, self.q_len, block_k,
                                           every=self.bias is not None)
            states, rest = _tables.unify(states, _tables.group_states(rest, group))
            slots, coords = _tables.slot_grid(states, rest)
            rows = _tables.split_rows(states, slots, splits, per_split)
            return (self._table_args(rows),
                    self._bits(coords, block_m, block_k, decode_group=group), len(coords) > 0)

        return self._remembered(("decode", block_m, block_k, splits, per_split), build)

    def _table_args(self, rows: Any) -> tuple[Any, ...]:
        """``(table, z stride, h stride, row stride, blocks per row)`` for a kernel."""
        import torch

        z, h, r, w = rows.shape
        table = torch.from_numpy(rows).to(self.torch_device)
        return table, h * r * w if z > 1 else 0, r * w if h > 1 else 0, w, (w - 2) // 3

    def _bits(self, coords: Any, block_q: int, block_k: int,
              decode_group: int | None = None) -> Any:
        from ._bits import bit_tiles

        return bit_tiles(self.rest, self.xp, self.device, self.to_torch, self.torch_device,
                         coords, block_q, block_k, self.q_len, self.kv_len, decode_group)


class Grid:
    """The block form on one grid: ``rows`` (per query block, for the forward and the
    dQ pass), ``columns`` (per key block, for the dK/dV pass) and the bit tiles."""

    def __init__(self, plan: MaskPlan, block_q: int, block_k: int) -> None:
        states, rest = plan.states(block_q, block_k)
        self.states = _tables.demote_ragged(states, plan.q_len, plan.kv_len, block_q, block_k,
                                            every=plan.bias is not None)
        self.slots, self.coords = _tables.slot_grid(self.states, rest)
        self.plan, self.block_q, self.block_k = plan, block_q, block_k

    @cached_property
    def rows(self) -> tuple[Any, ...]:
        return self.plan._table_args(_tables.table(self.states, self.slots))

    @cached_property
    def columns(self) -> tuple[Any, ...]:
        import numpy as np

        return self.plan._table_args(_tables.table(np.swapaxes(self.states, -1, -2),
                                                   np.swapaxes(self.slots, -1, -2)))

    @cached_property
    def bits(self) -> Any:
        return self.plan._bits(self.coords, self.block_q, self.block_k)

    @property
    def has_bits(self) -> bool:
        return len(self.coords) > 0


def plan_for(query: Any, key: Any, *, mask: Mask | None = None, causal: str | None = None,
             window: tuple[int | None, int | None] | None = None, key_lengths: Any = None,
             query_lengths: Any = None, bias: Any = None,
             score_mod: ScoreChange | None = None) -> MaskPlan:
    """The plan of a direct call on torch tensors: ``mask`` (any portattn mask) and the
    shorthands, combined with ``&`` and bound to the call, and ``score_mod`` (a change
    by distance, bound to the call too)."""
    from array_api_compat import array_namespace

    from portattn import masks

    *batch, hq, lq, _ = query.shape
    hkv, lk = key.shape[-3], key.shape[-2]
    if causal is not None and causal not in _ALIGNMENTS:
        msg = f"causal must be None, 'bottom_right' or 'top_left'; got causal={causal!r}"
        raise ValueError(msg)
    parts = [] if mask is None else [mask]
    if causal is not None:
        parts.append(masks.causal(causal))
    if window is not None:
        parts.append(masks.sliding_window(*window))
    for make, lengths in ((masks.key_lengths, key_lengths),
                          (masks.query_lengths, query_lengths)):
        if lengths is not None:
            parts.append(make(lengths.reshape(batch)))
    combined = None
    for part in parts:
        combined = part if combined is None else combined & part
    xp = array_namespace(query)
    if combined is not None:
        combined = combined.bind(xp, tuple(batch), hq, lq, lk, query.device)
    return MaskPlan(combined, xp, query.device, lambda x: x, query.device, tuple(batch), hq,
                    hkv, lq, lk, None if bias is None else bias_view(bias, batch, hq, lq, lk),
                    None if score_mod is None else _bound_distance(score_mod, xp, query.device,
                                                                   tuple(batch), hq, lq, lk))


def _bound_distance(score_mod: ScoreChange, xp: Any, device: Any, batch: tuple[int, ...],
                    heads: int, q_len: int, kv_len: int) -> ByDistance:
    """``score_mod`` bound to a direct call, by distance; a kind the kernels do not take
    is named."""
    from portattn.scores import ScoreChange

    from ._distance import KINDS, by_distance

    if not isinstance(score_mod, ScoreChange):
        msg = ("score_mod must be a portattn.scores change (scores.relative_position, "
               f"scores.alibi or their sum); got {type(score_mod).__name__}")
        raise TypeError(msg)
    change = score_mod.bind(xp, device, batch, heads, q_len, kv_len)
    if not change.additive or not change.kinds <= KINDS:
        msg = (f"score_mod={change!r}: the kernels take changes by distance "
               f"({', '.join(sorted(KINDS))} and their sums)")
        raise ValueError(msg)
    return by_distance(change, xp, q_len, kv_len, lambda x: x, device)


def bias_view(bias: Any, batch: Any, heads: int, q_len: int, kv_len: int) -> Any:
    """``bias`` broadcast to ``(Z, Hq, Lq, Lk)``, a view where the batch axes allow."""
    full = (*batch, heads, q_len, kv_len)
    try:
        expanded = bias.broadcast_to(full)
    except RuntimeError as e:
        msg = (f"bias of shape {tuple(bias.shape)} does not broadcast to "
               f"(*batch, Hq, Lq, Lk) = {full}")
        raise ValueError(msg) from e
    return expanded.reshape(math.prod(batch), heads, q_len, kv_len)
