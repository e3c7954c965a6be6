"""Pictures of masks: which (query, key) pairs a mask lets through for a call, as a
matplotlib image (:func:`show`, with the block form's tiles on top) or as text
(:func:`text`, for terminals and doctests).

The pairs come from the mask's own ``tile`` over the whole call, the way the reference
kernel reads a mask; the tiles come from :func:`~portattn.masks.block_mask`. Nothing is
derived twice, so a picture shows what the kernels see. matplotlib is imported only by
:func:`show`, when it is called.
"""

from __future__ import annotations

import math
import operator
import textwrap
from typing import Any

from .._lib import host_copy
from ._base import (
    FULL,
    HIDDEN,
    PARTIAL,
    Intersection,
    Mask,
    Union,
    before_creating,
    leaves,
)
from ._blocks import block_mask
from ._dense import Dense

__all__ = ["show", "text"]

#: Most pairs :func:`text` writes (one character each): 128 x 128.
TEXT_PAIRS = 1 << 14
#: Most pairs :func:`show` draws: 4096 x 4096, already finer than a screen.
SHOW_PAIRS = 1 << 24

ALLOWED_COLOR, HIDDEN_COLOR = "#1f4e79", "#eeeeee"
#: How each tile state is drawn: (name in the title, edge colour, face colour, legend).
#: Skipped tiles hold hidden pairs only, so a grey wash over them stays readable.
TILE_STYLES = {
    FULL: ("full", "#2ca02c", "none", "full tile (no elementwise mask)"),
    PARTIAL: ("partial", "#ff7f0e", "none", "partial tile (elementwise mask)"),
    HIDDEN: ("skipped", "#8c8c8c", (0.55, 0.55, 0.55, 0.35), "skipped tile"),
}
#: Skipped tiles first, partial ones last: the edges that matter most stay on top.
_DRAWING_ORDER = (HIDDEN, FULL, PARTIAL)
#: Most global token positions a title lists; more are counted instead.
TITLE_POSITIONS = 12


def show(mask: Any, q_len: int, kv_len: int, *, block: int | tuple[int, int] | None = None,
         batch: int = 0, head: int = 0, ax: Any = None) -> Any:
    """Draw which (query, key) pairs ``mask`` lets through for a call of ``q_len``
    queries and ``kv_len`` keys, and optionally the tiles a kernel visits.

    Rows are queries ``i``, columns keys ``j``; allowed pairs are dark, hidden ones
    light. With ``block``, the grid of ``block_q x block_k`` tiles of the mask's block
    form (:func:`~portattn.masks.block_mask`) is drawn on top: green edges for full
    tiles (computed without an elementwise mask), orange edges for partial ones
    (computed with it), a grey wash over skipped ones. The title gives the mask, the share
    of pairs allowed and, with ``block``, how many tiles are in each state.

    Masks that vary across batch elements and heads (``key_lengths(lengths)``,
    ``documents(ids)`` with ids of shape ``(batch, L)``, a per-head ``dense`` array)
    are drawn for one of them: ``batch`` is the flat index over the batch axes the
    mask's arrays have (row-major, as ``reshape(-1)`` counts; ``b`` of a mask
    function) and ``head`` the query head. An index past those the mask holds is an
    error; along an axis the mask does not vary over, every index draws the same
    picture (a mask function receives it as is). Arrays of any library are read back to
    the host; a mask function with no arrays beside it gets NumPy index arrays.

    Args:
        mask: A :class:`~portattn.masks.Mask`, a boolean array (as ``dense``), or None
            (every pair allowed).
        q_len: Number of queries of the call (``Lq``), at least 1.
        kv_len: Number of keys of the call (``Lk``), at least 1. ``q_len * kv_len`` may
            be at most 2**24.
        block: ``(block_q, block_k)``, positive tile sizes (one int for square tiles),
            to draw the block form; None draws the pairs only.
        batch: Flat batch index to draw, for masks that vary per batch element.
        head: Query head to draw, for masks that vary per head.
        ax: A matplotlib Axes to draw on; None makes a new figure.

    Returns:
        The matplotlib Axes drawn on. Its first image holds the pairs (1 = allowed),
        and with ``block`` its collections with gids ``tiles:full``,
        ``tiles:partial`` and ``tiles:skipped`` hold one rectangle per tile.

    Raises:
        ImportError: matplotlib is not installed (``pip install "portattn[plot]"``).
        TypeError: ``mask`` is not a mask, or an argument has the wrong type.
        ValueError: A size or index is out of range, or the mask does not fit the call.

    Example:
        >>> from matplotlib.figure import Figure
        >>> from portattn import masks
        >>> ax = masks.show(masks.causal(), 64, 64, block=16, ax=Figure().subplots())
        >>> print(ax.get_title())
        causal(bottom_right)
        50.8% of 64x64 pairs allowed
        16x16 tiles: 6 full, 4 partial, 6 skipped
        >>> ax.figure.savefig("causal.png")  # doctest: +SKIP
    """
    mask = _as_mask(mask, "show")
    q_len, kv_len = _length("q_len", q_len), _length("kv_len", kv_len)
    blocks = None if block is None else _block(block)
    _limit("show", q_len, kv_len, SHOW_PAIRS, "draw a shorter call (the pattern repeats) "
           "or read block_mask(...).states")
    call = _Call(mask, q_len, kv_len, batch, head)
    try:
        import matplotlib  # noqa: F401  (is it installed?)
    except ImportError as e:
        msg = 'portattn.masks.show needs matplotlib; install it with pip install "portattn[plot]"'
        raise ImportError(msg) from e
    if ax is not None:
        from matplotlib.axes import Axes

        if not isinstance(ax, Axes):
            msg = f"ax must be a matplotlib Axes or None; got ax={ax!r}"
            raise TypeError(msg)
    allowed = call.pairs()

    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(6.4, 6.4), layout="constrained")
    _draw_pairs(ax, allowed)
    title = [*textwrap.wrap(_named(mask, call.batch) if mask is not None else "no mask", 70),
             f"{allowed.mean():.1%} of {q_len}x{kv_len} pairs allowed{call.which()}"]
    handles = _pair_handles()
    if blocks is not None:
        states = call.states(*blocks)
        counts = _draw_tiles(ax, states, q_len, kv_len, *blocks)
        title.append(f"{blocks[0]}x{blocks[1]} tiles: " + ", ".join(
            f"{counts[s]} {TILE_STYLES[s][0]}" for s in (FULL, PARTIAL, HIDDEN)))
        handles += _tile_handles()
    ax.set_title("\n".join(title), fontsize="medium")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2,
              fontsize="small", frameon=False)
    return ax


def text(mask: Any, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0) -> str:
    """The pairs ``mask`` lets through for a call of ``q_len`` queries and ``kv_len``
    keys, as text: one line per query, ``#`` for an allowed key and ``.`` for a hidden
    one. For small calls (``q_len * kv_len`` at most 16384); :func:`show` draws larger
    ones. ``batch`` and ``head`` pick what to write as in :func:`show`.

    Args:
        mask: A :class:`~portattn.masks.Mask`, a boolean array (as ``dense``), or None
            (every pair allowed).
        q_len: Number of queries of the call (``Lq``), at least 1.
        kv_len: Number of keys of the call (``Lk``), at least 1.
        batch: Flat batch index to write, for masks that vary per batch element.
        head: Query head to write, for masks that vary per head.

    Returns:
        ``q_len`` lines of ``kv_len`` characters, joined by newlines (no trailing one).

    Example:
        >>> from portattn import masks
        >>> print(masks.text(masks.causal() & masks.sliding_window(2), 5, 5))
        #....
        ##...
        ###..
        .###.
        ..###
    """
    mask = _as_mask(mask, "text")
    q_len, kv_len = _length("q_len", q_len), _length("kv_len", kv_len)
    _limit("text", q_len, kv_len, TEXT_PAIRS, "use show() for larger calls")
    allowed = _Call(mask, q_len, kv_len, batch, head).pairs()
    return "\n".join("".join("#" if a else "." for a in row) for row in allowed.tolist())


class _Call:
    """One call's shapes, as far as the mask fixes them, and the mask bound to it."""

    def __init__(self, mask: Mask | None, q_len: int, kv_len: int, batch: Any,
                 head: Any) -> None:
        batch, head = _index("batch", batch), _index("head", head)
        batch_shape, heads, exact = _shape_of(mask)
        # Lengths, ids and positions fix the batch shape; a broadcast array only where
        # it is longer than 1.
        self.batch_fixed = batch_shape is not None and (exact or math.prod(batch_shape) > 1)
        self.heads_fixed = heads > 1
        if self.batch_fixed:
            count = math.prod(batch_shape)
            if batch >= count:
                msg = (f"batch={batch} is out of range: the mask holds {count} batch "
                       f"element{'s' * (count != 1)} (batch shape {batch_shape})")
                raise ValueError(msg)
        else:  # the mask does not vary per batch element: any index shows the same
            rank = max(1, len(batch_shape or ()))
            batch_shape = (1,) * (rank - 1) + (batch + 1,)
        if self.heads_fixed:
            if head >= heads:
                msg = f"head={head} is out of range: the mask holds {heads} heads"
                raise ValueError(msg)
        else:
            heads = head + 1
        self.mask, self.q_len, self.kv_len = mask, q_len, kv_len
        self.batch, self.head = batch, head
        self.batch_shape, self.heads = tuple(batch_shape), heads
        self.bound = None if mask is None else self._bind(mask)

    def _bind(self, mask: Mask) -> Mask:
        from array_api_compat import array_namespace, device

        arrays = mask.arrays
        if arrays:
            self.xp, self.device = array_namespace(*arrays), device(arrays[0])
        else:  # nothing tells the library: index arrays in NumPy
            import numpy as np

            self.xp, self.device = array_namespace(np.empty(0)), None
        return mask.bind(self.xp, self.batch_shape, self.heads, self.q_len, self.kv_len,
                         self.device)

    def _pick(self, a: Any, rows: int, cols: int) -> Any:
        """The chosen batch element and head of ``a``, which broadcasts against
        ``(*batch, H, rows, cols)`` (a size-1 axis is one shared by all)."""
        import numpy as np

        full = np.broadcast_to(a, (*self.batch_shape, self.heads, rows, cols))
        return full.reshape(-1, self.heads, rows, cols)[self.batch, self.head]

    def pairs(self) -> Any:
        """``(q_len, kv_len)`` NumPy booleans, True where the pair is allowed: the
        mask's tile over the whole call, as the reference kernel masks its scores."""
        import numpy as np

        if self.bound is None:
            return np.ones((self.q_len, self.kv_len), dtype=bool)
        tile = self.bound.tile(self.xp, 0, self.q_len, 0, self.kv_len, self.q_len,
                               self.kv_len, self.device)
        from array_api_compat import is_dask_array

        if is_dask_array(tile):  # lazy: a picture asks for the values
            tile = tile.compute()
        allowed = host_copy(tile)
        if allowed is None:
            msg = (f"the values of {self.mask!r} cannot be read here (inside jax.jit or "
                   "torch.compile?); draw a mask holding concrete arrays")
            raise ValueError(msg)
        return np.ascontiguousarray(self._pick(np.asarray(allowed, dtype=bool), self.q_len,
                                               self.kv_len))

    def states(self, block_q: int, block_k: int) -> Any:
        """``(n_q_blocks, n_kv_blocks)`` tile states of the block form, for the chosen
        batch element and head."""
        form = block_mask(self.bound, self.q_len, self.kv_len, block_q, block_k)
        return self._pick(form.states, form.num_q_blocks, form.num_kv_blocks)

    def which(self) -> str:
        """What the picture is of, where the mask varies."""
        parts = [f"batch {self.batch}"] * self.batch_fixed + [f"head {self.head}"] * \
            self.heads_fixed
        return f" ({', '.join(parts)})" if parts else ""


def _named(mask: Mask, batch: int) -> str:
    """``repr(mask)``, but global tokens by their positions (those of the batch element
    drawn) where they can be read: ``global_tokens([0, 5])`` says more than a shape."""
    if isinstance(mask, (Intersection, Union)):
        names = [_named(m, batch) for m in mask.members]
        if isinstance(mask, Intersection):
            return " & ".join(names)
        return "(" + " | ".join(names) + ")"
    if mask.kind == "global_tokens":
        return _global_tokens_named(mask, batch) or repr(mask)
    return repr(mask)


def _global_tokens_named(mask: Mask, batch: int) -> str | None:
    """``global_tokens([0, 5])``: the used (non-negative) positions, at most
    :data:`TITLE_POSITIONS` of them; None when they cannot be read (traced)."""
    import numpy as np
    from array_api_compat import is_dask_array

    positions = mask.positions
    if is_dask_array(positions):  # lazy: a picture asks for the values, as pairs() does
        positions = positions.compute()
    positions = host_copy(positions)
    if positions is None:
        return None
    rows = np.asarray(positions).reshape(-1, positions.shape[-1])
    row = 0 if len(rows) == 1 else batch  # one row: the same positions in every element
    if row >= len(rows):
        return None
    used = [int(p) for p in rows[row].tolist() if p >= 0]
    listed = ", ".join(map(str, used[:TITLE_POSITIONS]))
    if len(used) > TITLE_POSITIONS:
        listed += f", ... ({len(used)} positions)"
    moved = "".join(f", {n}={getattr(mask, n)}" for n in ("shift", "origin")
                    if getattr(mask, n, 0))
    return f"global_tokens([{listed}]{moved})"


def _shape_of(mask: Mask | None) -> tuple[tuple[int, ...] | None, int, bool]:
    """The batch shape and head count a call may have for ``mask``, from the shapes of
    its arrays (None and 1 where they say nothing), and whether the batch shape is
    required exactly. Shapes that disagree are left for ``bind`` to report."""
    import numpy as np

    exact, leads, heads = [], [], [1]
    for p in leaves(mask):
        for shape in _exact_shapes(p):
            exact.append(shape)
        if p.kind in ("dense", "block_layout"):
            shape = tuple((p.allowed if p.kind == "dense" else p.layout).shape)
            if len(shape) >= 3:
                heads.append(shape[-3])
                leads.append(shape[:-3])
    heads_count = max(heads)
    if exact:
        return exact[0], heads_count, True
    if leads:
        try:
            return tuple(np.broadcast_shapes(*leads)), heads_count, False
        except ValueError:
            return leads[0], heads_count, False  # bind names the array that does not fit
    return None, heads_count, False


def _exact_shapes(p: Mask) -> list[tuple[int, ...]]:
    """Batch shapes a part fixes exactly (per-sequence lengths, ids, positions)."""
    if p.kind in ("key_lengths", "query_lengths", "prefix"):
        return [tuple(p.lengths.shape)]
    if p.kind in ("key_ranges", "query_ranges"):
        return [tuple(p.start.shape)]
    if p.kind == "sequence_window":
        return [tuple(p.query_lengths.shape)]
    if p.kind == "documents":
        return [tuple(a.shape[:-1]) for a in (p.query_ids, p.key_ids) if len(a.shape) > 1]
    if p.kind == "global_tokens" and len(p.positions.shape) > 1:
        return [tuple(p.positions.shape[:-1])]
    return []


def _as_mask(mask: Any, function: str) -> Mask | None:
    if mask is None or isinstance(mask, Mask):
        return mask
    if hasattr(mask, "shape") and hasattr(mask, "dtype"):  # as attention(mask=...) takes it
        before_creating()
        return Dense(mask)
    msg = (f"{function} expects a portattn.masks mask, a boolean array or None; got "
           f"mask={mask!r} of type {type(mask).__name__}")
    raise TypeError(msg)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool):
        msg = f"{name} must be an int; got {name}={value!r}"
        raise TypeError(msg)
    try:
        return operator.index(value)
    except TypeError as e:
        msg = f"{name} must be an int; got {name}={value!r}"
        raise TypeError(msg) from e


def _length(name: str, value: Any) -> int:
    n = _integer(name, value)
    if n < 1:
        msg = f"{name} must be at least 1; got {name}={value!r}"
        raise ValueError(msg)
    return n


def _index(name: str, value: Any) -> int:
    n = _integer(name, value)
    if n < 0:
        msg = f"{name} must be a non-negative index; got {name}={value!r}"
        raise ValueError(msg)
    return n


def _block(block: Any) -> tuple[int, int]:
    if not isinstance(block, (tuple, list)):
        block = (block, block)
    msg = f"block must be (block_q, block_k), two positive ints; got block={block!r}"
    if len(block) != 2 or any(isinstance(b, bool) for b in block):
        raise ValueError(msg)
    try:
        sizes = tuple(operator.index(b) for b in block)
    except TypeError as e:
        raise TypeError(msg) from e
    if min(sizes) < 1:
        raise ValueError(msg)
    return sizes  # type: ignore[return-value]


def _limit(function: str, q_len: int, kv_len: int, limit: int, remedy: str) -> None:
    if q_len * kv_len > limit:
        msg = (f"{function} is for small calls: q_len * kv_len = {q_len} * {kv_len} = "
               f"{q_len * kv_len} exceeds {limit}; {remedy}")
        raise ValueError(msg)


def _draw_pairs(ax: Any, allowed: Any) -> None:
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    lq, lk = allowed.shape
    # Square pairs while that leaves a readable picture; a decode step (1 x Lk) stretches.
    aspect = "equal" if max(lq, lk) <= 4 * min(lq, lk) else "auto"
    ax.imshow(allowed.astype("uint8"), cmap=ListedColormap([HIDDEN_COLOR, ALLOWED_COLOR]),
              vmin=0, vmax=1, interpolation="nearest", aspect=aspect, gid="pairs")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions, never 0.5
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_tiles(ax: Any, states: Any, q_len: int, kv_len: int, block_q: int,
                block_k: int) -> dict[int, int]:
    """One collection of rectangles per tile state (thousands of tiles stay fast)."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    q0 = np.arange(states.shape[0]) * block_q
    k0 = np.arange(states.shape[1]) * block_k
    q1, k1 = np.minimum(q0 + block_q, q_len), np.minimum(k0 + block_k, kv_len)
    counts = {}
    # Pixel (i, j) covers [j - 0.5, j + 0.5] x [i - 0.5, i + 0.5], so a tile's box lies on
    # the edges of its first and last cells: every cell of a tile sits inside its box.
    # Where tiles of two states meet, the edge drawn later (partial) stays on top.
    for zorder, state in enumerate(_DRAWING_ORDER, start=2):
        name, edge, face, _ = TILE_STYLES[state]
        rows, cols = np.nonzero(states == state)
        counts[state] = len(rows)
        x0, x1 = k0[cols] - 0.5, k1[cols] - 0.5
        y0, y1 = q0[rows] - 0.5, q1[rows] - 0.5
        corners = np.stack([np.stack([x0, y0], -1), np.stack([x1, y0], -1),
                            np.stack([x1, y1], -1), np.stack([x0, y1], -1)], axis=1)
        ax.add_collection(PolyCollection(
            list(corners), facecolors=face, edgecolors=edge, zorder=zorder,
            linewidths=1.5 if state != HIDDEN else 0.75, gid=f"tiles:{name}",
            clip_on=False))  # boxes on the picture's border keep their whole edge
    return counts


def _pair_handles() -> list[Any]:
    from matplotlib.patches import Patch

    return [Patch(facecolor=ALLOWED_COLOR, label="allowed pair"),
            Patch(facecolor=HIDDEN_COLOR, edgecolor="#cccccc", label="hidden pair")]


def _tile_handles() -> list[Any]:
    from matplotlib.patches import Patch

    return [Patch(facecolor=face, edgecolor=edge, linewidth=1.5, label=label)
            for _, edge, face, label in TILE_STYLES.values()]
