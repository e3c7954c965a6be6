"""Attention of packed, variable-length queries to keys and values held in pages.

What serving needs: a batch that mixes new prompts (many queries) with sequences being
decoded (one query each), all of them packed into one ``(T, Hq, D)`` array, each
sequence attending its own keys, which live in fixed-size pages of a shared pool
listed by a block table (:class:`portattn.PagedKVCache` keeps one). The pages are read
where they are, a chunk at a time; nothing of the size of the batch times its longest
sequence is made.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace

from . import masks
from ._dispatch import PagedPlan, paged_kernel, paged_plan
from ._inputs import PagedInputs
from ._kernels import attend_pages, attend_pages_cascading, cascade_summary
from ._lib import check_like, dtype_name, host_values, safe_device
from ._models import integer_array

if TYPE_CHECKING:
    from .masks import Mask

__all__ = ["explain_paged", "paged_attention"]

LAYOUTS = ("blhd", "bhld")


def paged_attention(query: Any, key_pages: Any, value_pages: Any, /, *, block_table: Any,
                    key_lengths: Any, query_starts: Any = None, mask: Mask | None = None,
                    scale: float | None = None, softcap: float | None = None,
                    alibi_slopes: Any = None, sinks: Any = None, return_lse: bool = False,
                    layout: str = "blhd", cascade: bool = False) -> Any:
    """Exact attention of packed queries of ``S`` sequences to their paged keys.

    Sequence ``s`` has ``key_lengths[s]`` keys: its key ``j`` is row ``j % page`` of
    page ``block_table[s, j // page]`` of the pools. Its queries are rows
    ``query_starts[s]:query_starts[s + 1]`` of ``query`` (flash-attn's ``cu_seqlens``),
    and they are its *last* positions: with ``n`` queries, query ``i`` sits at position
    ``key_lengths[s] - n + i`` (bottom-right aligned, as in a cache that holds the new
    tokens' keys already). A batch may mix prefill chunks and single-token decodes.

    Under ``jax.jit`` the table, lengths and starts may be traced: the call is then
    checked by its shapes alone and planned on the device by ``jax_flash`` (kernels
    and the portable loop that plan on the host refuse it, naming the traced
    arguments); values the eager call would refuse make NaN the rows of the sequences
    they concern there.

    Args:
        query: ``(T, Hq, D)``, the queries of every sequence end to end.
        key_pages: the key pool, ``(P, page, Hkv, D)``, or ``(P, Hkv, page, D)`` with
            ``layout="bhld"``.
        value_pages: the value pool, the same with ``Dv``.
        block_table: integers ``(S, W)``: the pages of each sequence in order; entries
            past a sequence's length are not read (``-1`` is usual).
        key_lengths: integers ``(S,)``, each at most ``W * page``.
        query_starts: integers ``(S + 1,)`` from 0 to ``T``, non-decreasing, with at
            most ``key_lengths[s]`` queries for sequence ``s``; None for one query per
            sequence (a decode step, ``T == S``).
        mask: None (every key of the sequence) or a mask that reads positions alone,
            evaluated in each sequence's own positions: ``causal()``,
            ``sliding_window(...)``, ``sink_tokens(...)`` and ``chunks(...)``, combined
            with ``&`` and ``|``.
        scale: multiplies ``q @ k^T``; defaults to ``1/sqrt(D)``.
        softcap: scores become ``softcap * tanh(s / softcap)``.
        alibi_slopes: ``(Hq,)`` or ``(S, Hq)``: ``-slope * |i - j|`` joins the score of
            the query at position ``i`` and key ``j`` of a sequence (after softcap).
        sinks: ``(Hq,)`` or ``(S, Hq)``: each head's sink logit joins the softmax
            denominator.
        return_lse: also return the log-sum-exp ``(Hq, T)`` (flash-attn's varlen shape),
            float32 for half-precision queries.
        layout: ``"blhd"`` (a page is ``(page, Hkv, D)``, flash-attn's and vLLM's) or
            ``"bhld"`` (``(Hkv, page, D)``).
        cascade: sequences whose tables begin with the same pages (a prompt shared by
            samples or beams) read those pages once for all their queries, merged
            with the rest of each sequence by log-sum-exp. Taken where every query of
            such a group sees every shared key (``mask`` None or ``causal()``, no
            ``alibi_slopes``); the rest as without. A sequence's bits then depend on
            which others share its batch. Ignored where the table or lengths are traced
            (the shared pages are found on the host): the result is the same.

    Returns:
        ``out`` ``(T, Hq, Dv)`` in the dtype of ``query``; with ``return_lse``,
        ``(out, lse)``. A query that sees no key gives 0 and an lse of ``-inf``.

    Raises:
        ValueError: shapes or lengths that do not fit, a table entry in use outside
            the pool, or a mask that does not read positions alone.
        TypeError: arrays of different dtypes, libraries or devices.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> rng = np.random.default_rng(0)
        >>> pool = rng.standard_normal((8, 4, 2, 16), dtype=np.float32)  # 8 pages of 4
        >>> table = np.array([[5, 2, -1], [0, 7, 3]])         # two sequences' pages
        >>> lengths = np.array([6, 11])                       # keys of each
        >>> q = rng.standard_normal((4, 2, 16), dtype=np.float32)
        >>> starts = np.array([0, 3, 4])   # 3 queries (a prompt's end), then 1 (decode)
        >>> out = portattn.paged_attention(q, pool, pool, block_table=table,
        ...                                key_lengths=lengths, query_starts=starts,
        ...                                mask=masks.causal())
        >>> out.shape
        (4, 2, 16)
        >>> keys = pool[[0, 7, 3]].reshape(12, 2, 16)[:11]    # sequence 1 gathered
        >>> one = portattn.attention(q[3:], keys, keys, mask=masks.causal(), layout="blhd")
        >>> bool(np.allclose(out[3:], one, atol=1e-6))
        True
    """
    call = _checked(query, key_pages, value_pages, block_table, key_lengths, query_starts,
                    mask, scale, softcap, alibi_slopes, sinks, layout)
    kernel = paged_kernel(call)
    attend = attend_pages if kernel is None else kernel.run_paged
    out, lse = attend_pages_cascading(call, attend) if cascade else attend(call)
    return (out, lse) if return_lse else out


def explain_paged(query: Any, key_pages: Any, value_pages: Any, /, **kwargs: Any) -> PagedPlan:
    """What :func:`paged_attention` would do with the same arguments (``return_lse``
    and ``cascade`` are taken and ignored): which kernel runs the call, or the portable
    loop, every kernel's reasons, and what ``cascade=True`` would share. Checks the
    arguments as the call does. Works under ``jax.jit`` too, where the report says
    which arguments are traced and that the tiles are planned on the device.

    Returns:
        A :class:`~portattn.PagedPlan`; ``str(plan)`` reads like a report.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> pool = np.zeros((8, 4, 2, 16), dtype=np.float32)
        >>> plan = portattn.explain_paged(np.zeros((2, 2, 16), dtype=np.float32), pool,
        ...                               pool, block_table=np.array([[0, 1], [0, 2]]),
        ...                               key_lengths=np.array([6, 7]))
        >>> print(str(plan).splitlines()[2].split(", keys")[0].strip())
        2 sequences, 2 queries (2 decoding one token, 0 with more, 0 with none)
        >>> plan.cascade
        'read 1 page among sequences [0, 1] once'
    """
    kwargs.pop("return_lse", None)
    kwargs.pop("cascade", None)
    call = _checked(query, key_pages, value_pages, **_with_defaults(kwargs))
    return paged_plan(call, cascade_summary(call))


def _with_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of :func:`paged_attention` (less ``return_lse`` and ``cascade``) as
    the keywords of :func:`_checked`, with its defaults."""
    known = ("block_table", "key_lengths", "query_starts", "mask", "scale", "softcap",
             "alibi_slopes", "sinks", "layout")
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        msg = f"explain_paged() got unexpected keyword arguments {unknown}"
        raise TypeError(msg)
    for needed in ("block_table", "key_lengths"):
        if needed not in kwargs:
            msg = f"explain_paged() needs {needed}= (as paged_attention does)"
            raise TypeError(msg)
    defaults = {"query_starts": None, "mask": None, "scale": None, "softcap": None,
                "alibi_slopes": None, "sinks": None, "layout": "blhd"}
    return {**defaults, **kwargs}


def _checked(query: Any, key_pages: Any, value_pages: Any, block_table: Any,
             key_lengths: Any, query_starts: Any, mask: Mask | None, scale: float | None,
             softcap: float | None, alibi_slopes: Any, sinks: Any,
             layout: str) -> PagedInputs:
    xp = array_namespace(query)
    dev = safe_device(query)
    if layout not in LAYOUTS:
        msg = f"layout must be one of {LAYOUTS}; got layout={layout!r}"
        raise ValueError(msg)
    if not xp.isdtype(query.dtype, "real floating"):
        msg = f"query must hold real floating values; got query.dtype={dtype_name(query.dtype)}"
        raise TypeError(msg)
    for name, a in (("key_pages", key_pages), ("value_pages", value_pages)):
        check_like(xp, dev, a, name, "query")
        if a.dtype != query.dtype:
            msg = (f"{name}.dtype={dtype_name(a.dtype)} differs from "
                   f"query.dtype={dtype_name(query.dtype)}")
            raise TypeError(msg)
    q, k, v = tuple(query.shape), tuple(key_pages.shape), tuple(value_pages.shape)
    head_major = layout == "bhld"
    pool = "(P, Hkv, page, D)" if head_major else "(P, page, Hkv, D)"
    if len(q) != 3 or len(k) != 4 or len(v) != 4 or k[:3] != v[:3] or q[2] != k[3]:
        msg = (f"query must be (T, Hq, D) and key_pages, value_pages {pool} and "
               f"{pool.replace('D)', 'Dv)')} with one D; got query.shape={q}, "
               f"key_pages.shape={k}, value_pages.shape={v}")
        raise ValueError(msg)
    hkv = k[1] if head_major else k[2]
    if hkv == 0 or q[1] % hkv:
        msg = (f"the query heads must be a multiple of the key/value heads; got "
               f"Hq={q[1]}, Hkv={hkv}")
        raise ValueError(msg)
    table = integer_array(xp, dev, block_table, "block_table", 2, "query")
    sequences = table.shape[0]
    counts = _counts(xp, dev, table, key_lengths, query_starts, q[0],
                     page=k[2] if head_major else k[1], num_pages=k[0])
    check_mask(mask)
    if softcap is not None and not softcap > 0:
        msg = f"softcap must be > 0 or None; got softcap={softcap!r}"
        raise ValueError(msg)
    return PagedInputs(
        xp=xp, device_obj=dev, query=query, key_pages=key_pages, value_pages=value_pages,
        head_major=head_major, block_table=xp.astype(table, xp.int32), **counts, mask=mask,
        scale=1.0 / math.sqrt(q[2]) if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
        alibi_slopes=_per_sequence(xp, dev, alibi_slopes, "alibi_slopes", sequences, q[1]),
        sinks=_per_sequence(xp, dev, sinks, "sinks", sequences, q[1]))


def _counts(xp: Any, dev: Any, table: Any, key_lengths: Any, query_starts: Any,
            total: int, page: int, num_pages: int) -> dict[str, Any]:
    """The fields of :class:`PagedInputs` that the lengths, starts and table fill: read
    and checked on the host; where any of them is traced, checked by shape alone (the
    ones that can be read are kept as they are) and left to a kernel that plans the
    call on the device."""
    sequences = table.shape[0]
    lengths = _integers(xp, dev, key_lengths, "key_lengths", (sequences,))
    starts = None if query_starts is None else _integers(
        xp, dev, query_starts, "query_starts", (sequences + 1,))
    _check_query_count(total, sequences, starts)
    host_table, host_lengths = host_values(table), _ints(host_values(lengths))
    # without query_starts, one query per sequence: known whatever is traced
    host_starts = list(range(sequences + 1)) if starts is None else _ints(host_values(starts))
    if host_table is None or host_lengths is None or host_starts is None:
        return {"host_table": host_table, "key_lengths": host_lengths,
                "query_starts": host_starts, "key_counts": xp.astype(lengths, xp.int32),
                "query_offsets": xp.asarray(host_starts, dtype=xp.int32, device=dev)
                if starts is None else xp.astype(starts, xp.int32)}
    return _host_counts(xp, dev, host_table, host_lengths, host_starts, page, num_pages,
                        total)


def _ints(host: Any) -> list[int] | None:
    """A NumPy copy's values as ints; None stays None (values that cannot be read)."""
    return None if host is None else [int(x) for x in host.reshape(-1)]


def _integers(xp: Any, dev: Any, a: Any, name: str, shape: tuple[int, ...]) -> Any:
    """``a``, checked to be an integer array of ``shape`` beside the query."""
    a = integer_array(xp, dev, a, name, len(shape), "query")
    if tuple(a.shape) != shape:
        msg = f"{name} must have shape {shape}; got {name}.shape={tuple(a.shape)}"
        raise ValueError(msg)
    return a


def _check_query_count(total: int, sequences: int, starts: Any) -> None:
    """What the shapes alone say of the number of queries."""
    if starts is None and total != sequences:
        msg = (f"without query_starts, query holds one query per sequence; got "
               f"query.shape[0]={total} for {sequences} sequences")
        raise ValueError(msg)
    if sequences == 0 and total:
        msg = (f"with no sequences (block_table.shape[0]=0) query must be empty; got "
               f"query.shape[0]={total}")
        raise ValueError(msg)


def _host_counts(xp: Any, dev: Any, host_table: Any, lengths: list[int], starts: list[int],
                 page: int, num_pages: int, total: int) -> dict[str, Any]:
    """The table, lengths and starts read on the host, checked, with their device
    copies: the fields of :class:`PagedInputs` they fill."""
    capacity = host_table.shape[1] * page
    for s, n in enumerate(lengths):
        if not 0 <= n <= capacity:
            msg = (f"key_lengths must lie in [0, block_table.shape[1] * page="
                   f"{capacity}]; got key_lengths[{s}]={n}")
            raise ValueError(msg)
    _check_starts(starts, total, lengths)
    _check_table(host_table, lengths, page, num_pages)
    return {"host_table": host_table, "query_starts": starts, "key_lengths": lengths,
            "key_counts": xp.asarray(lengths, dtype=xp.int32, device=dev),
            "query_offsets": xp.asarray(starts, dtype=xp.int32, device=dev)}


def check_mask(mask: Any) -> None:
    """A paged call's mask must mean the same in every sequence."""
    if mask is not None and not masks.reads_positions_alone(mask):
        msg = (f"mask must read positions alone (causal, sliding_window, sink_tokens, "
               f"chunks, combined with & and |), to mean the same in every sequence; "
               f"got mask={mask!r}")
        raise ValueError(msg)


def _check_starts(starts: list[int], total: int, lengths: list[int]) -> None:
    if starts[0] != 0 or starts[-1] != total:
        msg = (f"query_starts must run from 0 to query.shape[0]={total}; got "
               f"query_starts[0]={starts[0]}, query_starts[-1]={starts[-1]}")
        raise ValueError(msg)
    for s in range(len(lengths)):
        n = starts[s + 1] - starts[s]
        if not 0 <= n <= lengths[s]:
            msg = (f"sequence {s} has {n} queries, which must lie in [0, key_lengths[{s}]="
                   f"{lengths[s]}] (its queries are its last positions); got "
                   f"query_starts[{s}:{s + 2}]={starts[s:s + 2]}")
            raise ValueError(msg)


def _check_table(host: Any, lengths: list[int], page: int, num_pages: int) -> None:
    """Every entry of the table (on the host) that a sequence reads must name a page of
    the pool (JAX would clamp an index outside it, silently)."""
    for s, n in enumerate(lengths):
        used = host[s, :-(-n // page)]
        if used.size and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            bad = [int(x) for x in used if not 0 <= x < num_pages][:4]
            msg = (f"block_table[{s}] names pages outside the pool of {num_pages} within "
                   f"the sequence's key_lengths[{s}]={n}; got pages {bad}")
            raise ValueError(msg)


def _per_sequence(xp: Any, dev: Any, a: Any, name: str, sequences: int,
                  heads: int) -> Any:
    """``(Hq,)`` or ``(S, Hq)`` as ``(S, Hq)``; None stays None."""
    if a is None:
        return None
    check_like(xp, dev, a, name, "query")
    shape = tuple(a.shape)
    if shape == (heads,):
        return xp.broadcast_to(xp.reshape(a, (1, heads)), (sequences, heads))
    if shape != (sequences, heads):
        msg = (f"{name} must have shape (Hq,)=({heads},) or (S, Hq)=({sequences}, {heads});"
               f" got {name}.shape={shape}")
        raise ValueError(msg)
    return a
