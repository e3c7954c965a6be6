"""Structured attention masks: a public protocol every kernel reads.

A mask says which (query i, key j) pairs may attend. Masks are small frozen objects,
not L x L arrays, so a kernel can tell from the structure alone which tiles are
fully hidden (and skip them) and build a boolean mask for one tile at a time.

Positions: with ``bottom_right`` alignment query ``i`` sits at absolute position
``i + (Lk - Lq)``; with ``top_left`` at ``i``. The two coincide when ``Lq == Lk``.
Every kind but ``causal("top_left")`` is bottom-right aligned. Masks combine with ``&``
(pairs allowed by every part) and ``|`` (pairs allowed by any). ``causal`` and
``sliding_window`` are aligned to the array lengths ``Lq`` and ``Lk``, so combining them
with ``key_lengths`` is a plain intersection; :func:`sequence_causal` and
:func:`sequence_window` align to each sequence's own lengths instead (flash-attn's
varlen convention).

What a kernel may ask, for a call of ``Lq`` queries and ``Lk`` keys:

- :func:`block_mask` (or ``AttentionInputs.blocks``): the block form, which tiles to
  skip, which to compute without a mask and which with one (:class:`BlockMask`,
  :class:`BlockTables`); the way every kernel should read a mask;
- :meth:`Mask.tile`: the boolean mask of one tile;
- :attr:`Mask.parts` and :attr:`Mask.kinds`: the kinds below, with their parameters
  as attributes; :meth:`Mask.band`: every causal and sliding-window part folded into
  one :class:`Band` (``lower <= j - i <= upper`` for query row ``i``, key ``j``);
- :meth:`Mask.key_range`, :meth:`Mask.covers`, :meth:`Mask.hides`: what one tile
  needs, known without reading data;
- :attr:`Mask.arrays` and :meth:`Mask.with_arrays`: the arrays inside, and the same
  mask holding other ones (pytrees, device moves, borrowing into another library);
- :meth:`Mask.restrict`: the mask of a sub-problem (split-KV, ring attention).

Tiles are boolean arrays (True = attend) of shape ``(tq, tk)`` or of full rank
``(*batch, H, tq, tk)`` with broadcastable 1s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._bands import Causal, SlidingWindow
from ._base import (
    FULL,
    HIDDEN,
    PARTIAL,
    POSITIONAL,
    Band,
    Grid,
    Intersection,
    Mask,
    Union,
    before_creating,
    combine_states,
    expand_to_rank,
    leaves,
    slice_tile,
    tile_states,
)
from ._blocks import BlockMask, BlockTables, block_mask
from ._dense import Dense, Function
from ._documents import Documents, ids_from_cu_seqlens
from ._lengths import KeyLengths, Prefix, QueryLengths
from ._queries import (
    BandAndLengths,
    BandAndTokens,
    band_and_lengths,
    band_and_tokens,
    head_dependence,
    intersection,
    is_positional,
    reads_positions_alone,
)
from ._ranges import KeyRanges, QueryRanges, SequenceWindow
from ._show import show, text
from ._sparse import BlockLayout, Chunks, GlobalTokens, SinkTokens

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "FULL",
    "HIDDEN",
    "KINDS",
    "PARTIAL",
    "POSITIONAL",
    "Band",
    "BandAndLengths",
    "BandAndTokens",
    "BlockLayout",
    "BlockMask",
    "BlockTables",
    "Causal",
    "Chunks",
    "Dense",
    "Documents",
    "Function",
    "GlobalTokens",
    "Grid",
    "Intersection",
    "KeyLengths",
    "KeyRanges",
    "Mask",
    "Prefix",
    "QueryLengths",
    "QueryRanges",
    "SequenceWindow",
    "SinkTokens",
    "SlidingWindow",
    "Union",
    "band_and_lengths",
    "band_and_tokens",
    "block_layout",
    "block_mask",
    "combine_states",
    "causal",
    "chunks",
    "dense",
    "documents",
    "documents_from_cu_seqlens",
    "expand_to_rank",
    "function",
    "global_tokens",
    "head_dependence",
    "intersection",
    "is_positional",
    "reads_positions_alone",
    "key_lengths",
    "key_ranges",
    "leaves",
    "prefix",
    "query_lengths",
    "query_ranges",
    "sequence_causal",
    "sequence_window",
    "show",
    "sink_tokens",
    "slice_tile",
    "tile_states",
    "sliding_window",
    "text",
]

KINDS = ("causal", "sliding_window", "key_lengths", "query_lengths", "dense", "key_ranges",
         "query_ranges", "sequence_window", "documents", "prefix", "sink_tokens",
         "global_tokens", "chunks", "block_layout", "function", "union")
"""The kinds a kernel may declare in ``Kernel.masks``. A kernel that reads the block
form and :meth:`Mask.tile` takes them all."""


def causal(alignment: str = "bottom_right") -> Causal:
    """Query at position ``p`` attends keys ``j <= p``.

    With ``"bottom_right"`` query ``i`` sits at ``p = i + Lk - Lq`` (the last query sees
    every key; a decoding step's convention); with ``"top_left"`` at ``p = i`` (torch's
    ``is_causal``). The two coincide when ``Lq == Lk``.

    Args:
        alignment: ``"bottom_right"`` or ``"top_left"``.

    Returns:
        A :class:`Causal` mask.

    Raises:
        ValueError: another ``alignment``.

    Example:
        >>> from portattn import masks
        >>> print(masks.text(masks.causal(), 3, 5))
        ###..
        ####.
        #####
        >>> print(masks.text(masks.causal("top_left"), 3, 5))
        #....
        ##...
        ###..
    """
    before_creating()
    return Causal(alignment)


def sliding_window(left: int | None, right: int | None = 0) -> SlidingWindow:
    """Query at (bottom-right aligned) position ``p`` attends ``p-left <= j <= p+right``.

    Both ends are inclusive; ``None`` leaves that side unbounded, so
    ``sliding_window(None, 0)`` equals ``causal()``.

    Args:
        left: keys visible before the query's position (an int >= 0, or None).
        right: keys visible after it (an int >= 0, or None); 0 keeps it causal.

    Returns:
        A :class:`SlidingWindow` mask.

    Raises:
        ValueError: ``left`` or ``right`` is neither None nor an int >= 0.

    Example:
        >>> from portattn import masks
        >>> print(masks.text(masks.sliding_window(1, 1), 5, 5))
        ##...
        ###..
        .###.
        ..###
        ...##
    """
    before_creating()
    return SlidingWindow(left, right)


def key_lengths(lengths: Any) -> KeyLengths:
    """Keys ``j >= lengths[b]`` of batch element ``b`` are padding (right padding).

    Args:
        lengths: integer array with the batch shape of the call, values in ``[0, Lk]``.

    Returns:
        A :class:`KeyLengths` mask.

    Raises:
        TypeError: ``lengths`` is not an array; a wrong dtype, shape or value
            raises when the mask meets a call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.key_lengths(np.array([2, 4]))
        >>> print(masks.text(mask, 2, 5, batch=0))
        ##...
        ##...
        >>> print(masks.text(mask, 2, 5, batch=1))
        ####.
        ####.
    """
    before_creating()
    return KeyLengths(lengths)


def query_lengths(lengths: Any) -> QueryLengths:
    """Queries ``i >= lengths[b]`` are padding: their rows are fully masked (output 0).

    Args:
        lengths: integer array with the batch shape of the call, values in ``[0, Lq]``.

    Returns:
        A :class:`QueryLengths` mask.

    Raises:
        TypeError: ``lengths`` is not an array; a wrong dtype, shape or value
            raises when the mask meets a call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.query_lengths(np.array([2])), 4, 4))
        ####
        ####
        ....
        ....
    """
    before_creating()
    return QueryLengths(lengths)


def dense(allowed: Any) -> Dense:
    """An explicit boolean mask (True = attend).

    Kernels read it through the block form like any other kind, but it costs an
    ``Lq x Lk`` array; prefer a structured kind where one fits.

    Args:
        allowed: boolean array broadcastable to ``(..., Hq, Lq, Lk)``.

    Returns:
        A :class:`Dense` mask.

    Raises:
        TypeError: ``allowed`` is not a boolean array.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> allowed = np.array([[True, False, True], [False, True, False]])
        >>> print(masks.text(masks.dense(allowed), 2, 3))
        #.#
        .#.
    """
    before_creating()
    return Dense(allowed)


def key_ranges(start: Any, stop: Any) -> KeyRanges:
    """Batch element ``b`` attends keys ``start[b] <= j < stop[b]`` only.

    Left padding is ``start`` = number of pad tokens, ``stop`` = ``Lk``.

    Args:
        start: integer array with the batch shape, values in ``[0, Lk]``.
        stop: integer array with the batch shape, values in ``[0, Lk]``.

    Returns:
        A :class:`KeyRanges` mask.

    Raises:
        TypeError: ``start`` or ``stop`` is not an array; a wrong dtype, shape or value
            raises when the mask meets a call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.key_ranges(np.array([2]), np.array([5])), 3, 5))
        ..###
        ..###
        ..###
    """
    before_creating()
    return KeyRanges(start, stop)


def query_ranges(start: Any, stop: Any) -> QueryRanges:
    """Queries outside ``start[b] <= i < stop[b]`` are padding: their rows are fully
    masked (output 0).

    Args:
        start: integer array with the batch shape, values in ``[0, Lq]``.
        stop: integer array with the batch shape, values in ``[0, Lq]``.

    Returns:
        A :class:`QueryRanges` mask.

    Raises:
        TypeError: ``start`` or ``stop`` is not an array; a wrong dtype, shape or value
            raises when the mask meets a call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.query_ranges(np.array([1]), np.array([3]))
        >>> print(mask, masks.text(mask, 4, 4), sep="\\n")
        query_ranges(shape=(1,))
        ....
        ####
        ####
        ....
    """
    before_creating()
    return QueryRanges(start, stop)


def sequence_window(left: int | None, right: int | None = 0, *, query_lengths: Any,
                    key_lengths: Any) -> Mask:
    """A sliding window aligned to each sequence's own lengths (flash-attn's varlen).

    Query ``i`` of batch element ``b`` sits at ``p = i + key_lengths[b] -
    query_lengths[b]`` and attends ``p - left <= j <= p + right``; queries
    ``i >= query_lengths[b]`` and keys ``j >= key_lengths[b]`` are padding. With equal
    lengths everywhere this is :func:`sliding_window` and :func:`key_lengths`.

    Args:
        left: keys visible before the query's position (an int >= 0, or None).
        right: keys visible after it (an int >= 0, or None).
        query_lengths: integer array with the batch shape, values in ``[0, Lq]``.
        key_lengths: integer array with the batch shape, values in ``[0, Lk]``.

    Returns:
        The intersection of the window with :func:`query_lengths` and
        :func:`key_lengths`.

    Raises:
        ValueError: ``left`` or ``right`` is neither None nor an int >= 0.
        TypeError: a length is not an array; a wrong dtype, shape or value
            raises when the mask meets a call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.sequence_window(1, 0, query_lengths=np.array([2, 3]),
        ...                              key_lengths=np.array([4, 5]))
        >>> print(masks.text(mask, 3, 5, batch=0))
        .##..
        ..##.
        .....
        >>> print(masks.text(mask, 3, 5, batch=1))
        .##..
        ..##.
        ...##
    """
    before_creating()
    return Intersection((SequenceWindow(query_lengths, key_lengths, left, right),
                         QueryLengths(query_lengths), KeyLengths(key_lengths)))


def sequence_causal(query_lengths: Any, key_lengths: Any) -> Mask:
    """Causal attention aligned to each sequence's own lengths (flash-attn's varlen
    ``causal=True``): ``sequence_window(None, 0, ...)``.

    Decoding a batch of caches of different lengths is
    ``sequence_causal(ones, cache_lengths)``.

    Args:
        query_lengths: integer array with the batch shape, values in ``[0, Lq]``.
        key_lengths: integer array with the batch shape, values in ``[0, Lk]``.

    Returns:
        The mask :func:`sequence_window` gives.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.sequence_causal(np.array([1, 1]), np.array([3, 5]))
        >>> print(masks.text(mask, 1, 5, batch=0))
        ###..
        >>> print(masks.text(mask, 1, 5, batch=1))
        #####
    """
    return sequence_window(None, 0, query_lengths=query_lengths, key_lengths=key_lengths)


def documents(segment_ids: Any, key_segment_ids: Any = None) -> Documents:
    """Packed sequences: query ``i`` attends key ``j`` only when their segment ids are
    equal; negative ids are padding and attend nothing.

    Combine with ``causal()`` for causal packed training.

    Args:
        segment_ids: integer array ``(*batch, Lq)`` or ``(Lq,)``.
        key_segment_ids: integer array ``(*batch, Lk)`` or ``(Lk,)``; defaults to
            ``segment_ids`` (for ``Lq == Lk``).

    Returns:
        A :class:`Documents` mask.

    Raises:
        TypeError: an argument is not an integer array.
        ValueError: its shape is neither ``(L,)`` nor ``(*batch, L)``.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.documents(np.array([0, 0, 1, 1, -1])), 5, 5))
        ##...
        ##...
        ..##.
        ..##.
        .....
    """
    before_creating()
    return Documents(segment_ids, segment_ids if key_segment_ids is None else key_segment_ids)


def documents_from_cu_seqlens(cu_seqlens: Any, length: int) -> Documents:
    """:func:`documents` from cumulative lengths (flash-attn's ``cu_seqlens``).

    Document ``d`` holds positions ``cu_seqlens[d] <= j < cu_seqlens[d + 1]`` of a row
    of ``length`` tokens; positions past the last document are padding.

    Args:
        cu_seqlens: integer array ``(*batch, n + 1)`` or ``(n + 1,)``, starting at 0 and
            non-decreasing.
        length: tokens per row (``L``).

    Returns:
        A :class:`Documents` mask.

    Raises:
        ValueError: ``cu_seqlens`` is not an integer array of cumulative lengths.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.documents_from_cu_seqlens(np.array([0, 2, 5]), 6), 6, 6))
        ##....
        ##....
        ..###.
        ..###.
        ..###.
        ......
    """
    before_creating()
    ids = ids_from_cu_seqlens(cu_seqlens, length)
    return Documents(ids, ids)


def prefix(lengths: Any) -> Prefix:
    """The first ``lengths[b]`` positions of batch element ``b`` attend each other in both
    directions: queries and keys at positions ``< lengths[b]``.

    A prefix-LM (T5, PaliGemma) is ``causal() | prefix(lengths)``.

    Args:
        lengths: integer array with the batch shape.

    Returns:
        A :class:`Prefix` mask.

    Raises:
        TypeError: ``lengths`` is not an array; a wrong dtype, shape or value
            raises when the mask meets a call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> print(masks.text(masks.causal() | masks.prefix(np.array([3])), 5, 5))
        ###..
        ###..
        ###..
        ####.
        #####
    """
    before_creating()
    return Prefix(lengths)


def sink_tokens(count: int) -> SinkTokens:
    """The first ``count`` keys are visible to every query (StreamingLLM's attention
    sinks).

    Args:
        count: number of sink keys, an int >= 0.

    Returns:
        A :class:`SinkTokens` mask.

    Raises:
        ValueError: ``count`` is not an int >= 0.

    Example:
        >>> from portattn import masks
        >>> mask = masks.causal() & (masks.sliding_window(1) | masks.sink_tokens(1))
        >>> print(masks.text(mask, 5, 5))
        #....
        ##...
        ###..
        #.##.
        #..##
    """
    before_creating()
    return SinkTokens(count)


def global_tokens(positions: Any) -> GlobalTokens:
    """Tokens at ``positions`` see every key and are seen by every query (Longformer,
    BigBird): ``sliding_window(256, 256) | global_tokens(positions)``.

    Args:
        positions: integer array ``(n,)`` or ``(*batch, n)``, values in ``[0, Lk)``;
            negative entries are unused.

    Returns:
        A :class:`GlobalTokens` mask.

    Raises:
        TypeError: ``positions`` is not an array; a wrong dtype, shape or value
            raises when the mask meets a call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> mask = masks.sliding_window(1, 1) | masks.global_tokens(np.array([0]))
        >>> print(masks.text(mask, 5, 5))
        #####
        ###..
        ####.
        #.###
        #..##
    """
    before_creating()
    return GlobalTokens(positions)


def chunks(size: int) -> Chunks:
    """Query and key attend only inside the same chunk of ``size`` positions (Llama 4's
    chunked attention: ``causal() & chunks(8192)``).

    Args:
        size: positions per chunk, an int >= 1.

    Returns:
        A :class:`Chunks` mask.

    Raises:
        ValueError: ``size`` is not an int >= 1.

    Example:
        >>> from portattn import masks
        >>> print(masks.text(masks.causal() & masks.chunks(2), 5, 5))
        #....
        ##...
        ..#..
        ..##.
        ....#
    """
    before_creating()
    return Chunks(size)


def block_layout(layout: Any, block_q: int, block_k: int | None = None) -> BlockLayout:
    """One boolean per pair of position blocks (BigBird's random blocks, the Sparse
    Transformer's strided patterns).

    Query at position ``p`` attends key ``j`` when
    ``layout[..., p // block_q, j // block_k]``.

    Args:
        layout: boolean array ``(R, C)`` or broadcastable to ``(*batch, H, R, C)`` with
            ``R = ceil(Lk / block_q)``, ``C = ceil(Lk / block_k)``.
        block_q: positions per row block, an int >= 1.
        block_k: positions per column block; defaults to ``block_q``.

    Returns:
        A :class:`BlockLayout` mask.

    Raises:
        TypeError: ``layout`` is not a boolean array.
        ValueError: a block size is not an int >= 1, or the layout's shape does not
            fit the call.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> layout = np.array([[True, False], [True, True]])
        >>> print(masks.text(masks.block_layout(layout, 2), 4, 4))
        ##..
        ##..
        ####
        ####
    """
    before_creating()
    return BlockLayout(layout, block_q, block_q if block_k is None else block_k)


def function(fn: Callable[..., Any], args: tuple[Any, ...] | None = None) -> Function:
    """Pairs for which ``fn(b, h, q_idx, kv_idx, *args)`` is True (FlexAttention's
    ``mask_mod``).

    ``fn`` is evaluated tile by tile. Give the arrays it reads as ``args`` (they are
    then passed after the indices): they are copied into each call like any mask's
    arrays, so the call sees them as they were when it began, and the block form,
    which reads every pair, is remembered while their contents stay the same (under
    ``jax.jit`` they are traced arguments, not constants). Without ``args``, ``fn`` may
    read anything, so its block form is built anew at every call. Either way ``fn``
    must give the same answers until the call's backward has run.

    Args:
        fn: a callable of ``b`` (the flat batch index), ``h`` (the query head), ``q_idx``
            and ``kv_idx`` (array indices), all integer arrays of the call's library that
            broadcast together, then the ``args``; written with operators and that
            library's functions, it returns a boolean array.
        args: the arrays ``fn`` reads besides the indices (any library, or Python
            integers), declaring that it reads nothing else; ``()`` for a function of
            the indices alone. None (the default): unknown.

    Returns:
        A :class:`Function` mask.

    Raises:
        TypeError: ``fn`` is not callable, or ``args`` is not a tuple of arrays.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> in_pairs = masks.function(lambda b, h, q, k: (q >= k) & (q // 2 == k // 2))
        >>> print(masks.text(in_pairs, 4, 4))
        #...
        ##..
        ..#.
        ..##
        >>> def same_doc(b, h, q, k, doc):
        ...     return doc[q] == doc[k]
        >>> print(masks.text(masks.function(same_doc, args=(np.array([0, 0, 1, 1]),)), 4, 4))
        ##..
        ##..
        ..##
        ..##
    """
    before_creating()
    return Function(fn, args=None if args is None else tuple(args) if isinstance(
        args, list) else args)


#: Names this package exported before they moved, for a release: probes of array
#: libraries live in :mod:`portattn.kernel` now, range checks stay private.
_MOVED = {"dtype_text": "dtype_name", "jax_tracer_type": "jax_tracer_type",
          "torch_compiling": "torch_compiling", "values_readable": "values_readable",
          "signed": None, "check_range": None}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        msg = f"module 'portattn.masks' has no attribute {name!r}"
        raise AttributeError(msg)
    import warnings

    from .. import _lib
    from . import _values

    new = _MOVED[name]
    where = f"portattn.kernel.{new}" if new else "no public name (an internal check)"
    warnings.warn(f"portattn.masks.{name} moved: {where}", DeprecationWarning, stacklevel=2)
    return getattr(_lib, new) if new else getattr(_values, name)
