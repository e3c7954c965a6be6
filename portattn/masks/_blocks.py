"""The block form of a mask: which tiles of a call a kernel visits, and which of
those need the elementwise mask.

A call's ``Lq x Lk`` pairs are cut into tiles of ``block_q x block_k``. Each tile is
:data:`HIDDEN` (skip it), :data:`FULL` (every pair allowed: no mask needed) or
:data:`PARTIAL` (compute it with the mask's ``tile``), per batch element and head where
the mask varies across them. The states come from each kind's ``block_states``,
built from its structure (and host copies of small arrays) in time proportional to the
number of tiles; only ``dense`` masks and mask functions read every pair. Where values
cannot be read (``jax.jit``, ``torch.compile``, Dask) the parts that depend on them
count as partial everywhere: the same answer, fewer tiles skipped.

Like FlexAttention's ``BlockMask`` and splash attention's ``MaskInfo``, for any
library: :meth:`BlockMask.kv_blocks` and :meth:`BlockMask.q_blocks` serve loops on the
host; :meth:`BlockMask.tables` gives the index tables a compiled kernel reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .._lib import torch_compiling
from ._base import FULL, HIDDEN, PARTIAL, Grid

if TYPE_CHECKING:
    from ._base import Mask

__all__ = ["BlockMask", "BlockTables", "block_mask"]

#: Block forms, remembered by their masks' content keys (``Mask.content_key``) and grids.
CACHE_SIZE = 128
_cache: OrderedDict[tuple, BlockMask] = OrderedDict()
_cache_lock = threading.Lock()


@dataclass(frozen=True, eq=False)
class BlockTables:
    """A block form as index tables (NumPy int32), FlexAttention's layout.

    For each query block ``a`` (leading axes broadcast against ``(*batch, H)``):
    ``kv_indices[..., a, :kv_num_blocks[..., a]]`` are its partial key blocks and
    ``full_kv_indices[..., a, :full_kv_num_blocks[..., a]]`` its full ones, in
    increasing order (entries past the count are padding). The ``q_`` tables are the
    transpose, for each key block its query blocks (a backward's dK/dV pass).
    Made by :meth:`BlockMask.tables`.

    Example:
        >>> from portattn import masks
        >>> tables = masks.block_mask(masks.causal(), 8, 8, 4, 4).tables()
        >>> tables.kv_num_blocks.tolist(), tables.kv_indices.tolist()
        ([1, 1], [[0, 1], [1, 0]])
        >>> tables.full_kv_num_blocks.tolist(), tables.full_kv_indices[1, :1].tolist()
        ([0, 1], [0])
    """

    kv_num_blocks: Any
    kv_indices: Any
    full_kv_num_blocks: Any
    full_kv_indices: Any
    q_num_blocks: Any
    q_indices: Any
    full_q_num_blocks: Any
    full_q_indices: Any


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The block form of ``mask`` for a call of ``q_len`` queries and ``kv_len`` keys
    on a grid of ``block_q x block_k`` tiles.

    ``states`` is a NumPy int8 array ``(*lead, n_q_blocks, n_kv_blocks)`` of
    :data:`HIDDEN`, :data:`PARTIAL` and :data:`FULL`, whose leading axes broadcast
    against ``(*batch, H)`` (none when every batch element and head sees the same
    tiles). ``mask`` is the bound mask whose ``tile`` masks the partial tiles.
    Made by :func:`block_mask` or
    :meth:`AttentionInputs.blocks <portattn.kernel.AttentionInputs.blocks>`.

    Example:
        >>> from portattn import masks
        >>> blocks = masks.block_mask(masks.causal(), 8, 8, 4, 4)
        >>> blocks
        BlockMask(Lq=8, Lk=8, tiles of 4x4: 2x2, 75.0% visible, 50.0% partial)
        >>> blocks.states.tolist()  # 0 hidden, 1 partial, 2 full
        [[1, 0], [2, 1]]
        >>> blocks.kv_blocks(1)  # (key block, full) visited by query block 1
        [(0, True), (1, False)]
        >>> blocks.q_range(1), blocks.kv_range(0)
        ((4, 8), (0, 4))
    """

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    states: Any
    mask: Mask | None = None

    @property
    def num_q_blocks(self) -> int:
        """Query blocks, ``ceil(q_len / block_q)``."""
        return int(self.states.shape[-2])

    @property
    def num_kv_blocks(self) -> int:
        """Key blocks, ``ceil(kv_len / block_k)``."""
        return int(self.states.shape[-1])

    def q_range(self, a: int) -> tuple[int, int]:
        """Rows ``[q0, q1)`` of query block ``a``."""
        return a * self.block_q, min(self.q_len, (a + 1) * self.block_q)

    def kv_range(self, b: int) -> tuple[int, int]:
        """Keys ``[k0, k1)`` of key block ``b``."""
        return b * self.block_k, min(self.kv_len, (b + 1) * self.block_k)

    @cached_property
    def merged(self) -> Any:
        """``(n_q_blocks, n_kv_blocks)`` states for a kernel that computes every batch
        element and head of a tile at once: hidden only where hidden for all of them,
        full only where full for all of them."""
        import numpy as np

        if self.states.ndim == 2:
            return self.states
        if not self.states.size:  # no batch element or head: nothing to visit
            return np.full(self.states.shape[-2:], HIDDEN, dtype=np.int8)
        axes = tuple(range(self.states.ndim - 2))
        high, low = self.states.max(axis=axes), self.states.min(axis=axes)
        return np.where(high == HIDDEN, HIDDEN, np.where(low == FULL, FULL, PARTIAL)).astype(
            np.int8)

    @cached_property
    def _kv_lists(self) -> list[list[tuple[int, bool]]]:
        return [[(int(b), bool(row[b] == FULL)) for b in row.nonzero()[0]]
                for row in self.merged]

    @cached_property
    def _q_lists(self) -> list[list[tuple[int, bool]]]:
        return [[(int(a), bool(col[a] == FULL)) for a in col.nonzero()[0]]
                for col in self.merged.T]

    def kv_blocks(self, a: int) -> list[tuple[int, bool]]:
        """``(key block, full)`` for every key block query block ``a`` visits, in
        order, over all batch elements and heads (see :attr:`merged`)."""
        return self._kv_lists[a]

    def q_blocks(self, b: int) -> list[tuple[int, bool]]:
        """``(query block, full)`` for every query block that visits key block ``b``."""
        return self._q_lists[b]

    def tables(self) -> BlockTables:
        """The block form as FlexAttention-style index tables (see :class:`BlockTables`)."""
        partial, full = _lists(self.states == PARTIAL), _lists(self.states == FULL)
        t_partial = _lists(_transposed(self.states == PARTIAL))
        t_full = _lists(_transposed(self.states == FULL))
        return BlockTables(*partial, *full, *t_partial, *t_full)

    @cached_property
    def visible(self) -> float:
        """Fraction of the pairs that lie in visited tiles (averaged over batch and
        heads): the share of full attention's work a block-skipping kernel does."""
        return self._share(self.states != HIDDEN)

    @cached_property
    def partial(self) -> float:
        """Fraction of the pairs that lie in partial tiles."""
        return self._share(self.states == PARTIAL)

    def _share(self, selected: Any) -> float:
        import numpy as np

        if not self.q_len or not self.kv_len:
            return 0.0
        rows = np.diff(np.minimum(np.arange(self.num_q_blocks + 1) * self.block_q, self.q_len))
        cols = np.diff(np.minimum(np.arange(self.num_kv_blocks + 1) * self.block_k,
                                  self.kv_len))
        area = (selected * rows[:, None] * cols[None, :]).sum(axis=(-2, -1))
        return float(np.mean(area)) / (self.q_len * self.kv_len)

    def __repr__(self) -> str:
        lead = f", per {tuple(self.states.shape[:-2])}" if self.states.ndim > 2 else ""
        return (f"BlockMask(Lq={self.q_len}, Lk={self.kv_len}, tiles of "
                f"{self.block_q}x{self.block_k}: {self.num_q_blocks}x{self.num_kv_blocks}"
                f"{lead}, {self.visible:.1%} visible, {self.partial:.1%} partial)")


class _EveryTile(BlockMask):
    """Every tile partial, known without NumPy (``states`` is None): what a call
    traced by torch.compile visits when no eager call built its block form. The
    same answer; no tile skipped."""

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_len // self.block_k)

    def kv_blocks(self, a: int) -> list[tuple[int, bool]]:
        return [(b, False) for b in range(self.num_kv_blocks)]

    def q_blocks(self, b: int) -> list[tuple[int, bool]]:
        return [(a, False) for a in range(self.num_q_blocks)]

    def tables(self) -> BlockTables:
        msg = ("a call traced by torch.compile has no index tables for its mask unless "
               "an eager call with the same mask and sizes built its block form first")
        raise RuntimeError(msg)

    def __repr__(self) -> str:
        return (f"BlockMask(Lq={self.q_len}, Lk={self.kv_len}, tiles of "
                f"{self.block_q}x{self.block_k}: {self.num_q_blocks}x{self.num_kv_blocks}, "
                "every tile visited)")


def _lists(selected: Any) -> tuple[Any, Any]:
    """Counts and indices (selected first, in order) along the last axis."""
    import numpy as np

    counts = selected.sum(axis=-1).astype(np.int32)
    order = np.argsort(~selected, axis=-1, kind="stable").astype(np.int32)
    return counts, order


def _transposed(a: Any) -> Any:
    import numpy as np

    return np.swapaxes(a, -1, -2)


def block_mask(mask: Mask | None, q_len: int, kv_len: int, block_q: int,
               block_k: int) -> BlockMask:
    """The block form of a mask on a grid of ``block_q x block_k`` tiles.

    Built once per mask object and grid, and shared by masks of equal
    :meth:`~Mask.content_key` (the last 128 forms): a mask with no content key (a mask
    function that does not declare what it reads, large or unreadable arrays) builds
    its own at each call. Kernels usually call
    :meth:`AttentionInputs.blocks <portattn.kernel.AttentionInputs.blocks>`, which
    passes the call's bound mask.

    Args:
        mask: the mask bound to the call (:meth:`Mask.bind`; causal and
            sliding-window masks are the same bound or not), or None (every pair
            allowed).
        q_len: the call's queries, ``Lq``.
        kv_len: the call's keys, ``Lk``.
        block_q: rows per tile (the last block may be shorter).
        block_k: keys per tile (the last block may be shorter).

    Returns:
        A :class:`BlockMask`, read-only; with ``mask=None`` every tile is
        :data:`FULL`.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.block_mask(masks.causal(), 8, 8, 4, 4).states.tolist()
        [[1, 0], [2, 1]]
        >>> lengths = masks.key_lengths(np.array([3, 8])).bind(np, (2,), 2, 8, 8)
        >>> masks.block_mask(lengths, 8, 8, 4, 4).states[:, 0].tolist()  # per sequence
        [[[1, 0], [1, 0]], [[2, 2], [2, 2]]]
    """
    key = (q_len, kv_len, block_q, block_k)
    if torch_compiling():
        return _while_tracing(mask, key)
    if mask is None:
        return _shared((None, *key), lambda: _build(None, *key))
    own = mask.__dict__.get("_block_masks")
    if own is None:  # masks are frozen: the memo is set once, like a field
        own = {}
        object.__setattr__(mask, "_block_masks", own)
    found = own.get(key)
    if found is None:
        if "content" not in own:  # once per mask: a bound mask's arrays never change
            own["content"] = mask.content_key()
        content = own["content"]
        found = _build(mask, *key) if content is None else _shared(
            (content, *key), lambda: _build(mask, *key))
        own[key] = found
    return found


def _shared(key: tuple, build: Any) -> BlockMask:
    """The block form remembered under ``key`` (a content key and a grid), or ``build()``'s."""
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    found = build()
    with _cache_lock:
        _cache[key] = found
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return found


def _while_tracing(mask: Mask | None, key: tuple[int, int, int, int]) -> BlockMask:
    """The block form while torch.compile traces, which can follow neither a lock nor
    the NumPy that builds a form (its values would be the graph's, unknown to the host
    loops): one built before, by an eager call, for a mask of parameters alone (its
    content key is its key, read without values), or every tile visited."""
    if mask is None or not mask.arrays:  # a dict read needs no lock
        content = None if mask is None else mask.content_key()
        found = None if mask is not None and content is None else _cache.get((content, *key))
        if found is not None:
            return found
    return _EveryTile(*key, None, mask)


def _build(mask: Mask | None, q_len: int, kv_len: int, block_q: int,
           block_k: int) -> BlockMask:
    import numpy as np

    grid = Grid.uniform(q_len, kv_len, block_q, block_k)
    shape = (len(grid.q_edges) - 1, len(grid.k_edges) - 1)
    states = None if mask is None else mask.block_states(grid)
    if states is None:
        fill = FULL if mask is None else PARTIAL
        states = np.full(shape, fill, dtype=np.int8)
    elif states.shape[-2:] != shape:  # a part that depends on one axis only
        states = np.broadcast_to(states, (*states.shape[:-2], *shape))
    states.setflags(write=False)
    return BlockMask(q_len, kv_len, block_q, block_k, states, mask)
