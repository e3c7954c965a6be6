"""flash-attn's call shapes on any array library.

``flash_attn_varlen_func`` (packed sequences of different lengths, keys contiguous or
in pages) and ``flash_attn_with_kvcache`` (queries against a cache, new keys written
into it first) with flash-attn's arguments, so code written against flash-attn runs on
NumPy, torch, JAX, array-api-strict, ... Both are :func:`portattn.paged_attention`
underneath: contiguous keys are a pool of pages of one token each (a free reshape),
a ``(B, L, H, D)`` cache a pool of ``B`` pages of ``L`` tokens. What flash-attn
computes differently or not at all is refused with an error that says so (dropout,
rotary embeddings, left padding of the cache).
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace, is_writeable_array

from ._call import attention
from ._lib import safe_device
from ._models import flash_args, host_ints, int_at_least
from .paged import paged_attention

if TYPE_CHECKING:
    from .masks import Mask

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache"]


def flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Any = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Any = None, *,
                           seqused_k: Any = None) -> Any:
    """Attention of packed sequences of different lengths, as flash-attn's function.

    Sequence ``s`` has the queries ``q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]]`` and the
    keys ``k[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]`` (the first ``seqused_k[s]`` of them
    when given), or with ``block_table`` the keys held in the pages ``block_table[s]``
    of the pools ``k`` and ``v``. Its ``n`` queries are aligned to the end of its ``m``
    keys: query ``i`` sits at position ``m - n + i`` (``causal``, ``window_size`` and
    ALiBi read these positions; a query before the first key sees none under
    ``causal``). Results do not depend on ``deterministic``: they are always the same.

    Args:
        q: ``(total_q, Hq, D)``, the queries of every sequence end to end.
        k: ``(total_k, Hkv, D)``, or with ``block_table`` the pool of pages
            ``(num_blocks, page_block_size, Hkv, D)``. ``Hq`` is a multiple of ``Hkv``.
        v: like ``k``, with its own head dimension ``Dv``.
        cu_seqlens_q: integers ``(S + 1,)``, from 0 to ``total_q``, non-decreasing.
        cu_seqlens_k: integers ``(S + 1,)``, non-decreasing, at most ``total_k``; with
            ``block_table`` only their differences (the key lengths) are read.
        max_seqlen_q: at least the most queries of a sequence (checked).
        max_seqlen_k: at least the most keys of a sequence (checked).
        dropout_p: must be 0: dropout is not supported here.
        softmax_scale: multiplies ``q @ k^T``; ``1/sqrt(D)`` when None.
        causal: a query attends the keys up to its position.
        window_size: ``(left, right)``: a query at position ``p`` attends keys
            ``p - left <= j <= p + right``; ``-1`` leaves a side unbounded. ``causal``
            makes ``right`` 0.
        softcap: scores become ``softcap * tanh(s / softcap)``; 0.0 for none.
        alibi_slopes: ``(Hq,)`` or ``(S, Hq)``: ``-slope * |p - j|`` joins the score of
            the query at position ``p`` and key ``j`` (after softcap).
        deterministic: accepted and ignored.
        return_attn_probs: also return the log-sum-exp and (in the place of
            flash-attn's dropout pattern) None.
        block_table: integers ``(S, W)``: the pages of each sequence in order;
            entries past its length are not read.
        seqused_k: integers ``(S,)``: the keys sequence ``s`` uses, at most its
            ``cu_seqlens_k`` length (contiguous keys) or ``W * page_block_size``.

    Returns:
        ``out`` ``(total_q, Hq, Dv)`` in the dtype of ``q``; with
        ``return_attn_probs``, ``(out, softmax_lse, None)`` with ``softmax_lse``
        ``(Hq, total_q)`` (float32 for half-precision ``q``). A query that sees no key
        gives 0 and an lse of ``-inf`` (flash-attn's CUDA kernels write ``+inf``).

    Raises:
        ValueError: shapes or lengths that do not fit, ``dropout_p`` other than 0, a
            bad ``window_size``, ``softcap``, ``max_seqlen_q`` or ``max_seqlen_k``.
        TypeError: arrays of different dtypes, libraries or devices.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> from portattn.flash_attn import flash_attn_varlen_func
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((5, 4, 16), dtype=np.float32)    # 2 + 3 queries
        >>> k, v = (rng.standard_normal((9, 2, 16), dtype=np.float32) for _ in "kv")
        >>> cu_q, cu_k = np.array([0, 2, 5], np.int32), np.array([0, 4, 9], np.int32)
        >>> out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True)
        >>> out.shape
        (5, 4, 16)
        >>> one = portattn.attention(q[2:], k[4:], v[4:], mask=masks.causal(), layout="blhd")
        >>> bool(np.allclose(out[2:], one, atol=1e-6))
        True
    """
    xp, dev = array_namespace(q), safe_device(q)
    flash_args.check_dropout(dropout_p)
    mask = flash_args.window_mask(causal, window_size)
    cap = flash_args.softcap(softcap)
    flash_args.check_arrays(xp, dev, ("q", q), ("k", k), ("v", v))
    paged = block_table is not None
    want = 4 if paged else 3
    if q.ndim != 3 or k.ndim != want or v.ndim != want or k.shape[:-1] != v.shape[:-1]:
        what = "(num_blocks, page_block_size, Hkv, D)" if paged else "(total_k, Hkv, D)"
        msg = (f"q must be (total_q, Hq, D) and k, v {what} with one shape but the last;"
               f" got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, "
               f"v.shape={tuple(v.shape)}")
        raise ValueError(msg)
    flash_args.check_heads(q.shape[-2:], k.shape[-2:], "q", "k")
    cu_q = host_ints(xp, dev, cu_seqlens_q, "cu_seqlens_q", None, "q")
    if not cu_q or cu_q[0] != 0 or cu_q[-1] != q.shape[0]:
        msg = (f"cu_seqlens_q must run from 0 to q.shape[0]={q.shape[0]}; got "
               f"cu_seqlens_q={flash_args.short(cu_q)}")
        raise ValueError(msg)
    flash_args.check_rising(cu_q, "cu_seqlens_q")
    sequences = len(cu_q) - 1
    cu_k = host_ints(xp, dev, cu_seqlens_k, "cu_seqlens_k", (sequences + 1,), "q")
    flash_args.check_rising(cu_k, "cu_seqlens_k")
    lengths = [b - a for a, b in pairwise(cu_k)]
    if seqused_k is not None:
        used = host_ints(xp, dev, seqused_k, "seqused_k", (sequences,), "q")
        for s, (n, most) in enumerate(zip(used, lengths, strict=True)):
            if n < 0 or (n > most and not paged):
                msg = (f"seqused_k[{s}] must lie in [0, cu_seqlens_k[{s + 1}] - "
                       f"cu_seqlens_k[{s}]={most}]; got seqused_k[{s}]={n}")
                raise ValueError(msg)
        lengths = used
    flash_args.check_slopes(xp, dev, alibi_slopes, sequences, q.shape[1])
    counts = [b - a for a, b in pairwise(cu_q)]
    flash_args.check_max("max_seqlen_q", max_seqlen_q, counts, "queries")
    flash_args.check_max("max_seqlen_k", max_seqlen_k, lengths, "keys")
    if paged:
        pages, page = k.shape[0], k.shape[1]
        host_table = flash_args.host_table(xp, dev, block_table, sequences, "len(cu_seqlens_q) - 1")
        room = page * block_table.shape[1]
        for s, n in enumerate(lengths):
            if n > room:
                name = (f"seqused_k[{s}]" if seqused_k is not None
                        else f"cu_seqlens_k[{s + 1}] - cu_seqlens_k[{s}]")
                msg = (f"{name}={n} keys do not fit the {block_table.shape[1]} pages of "
                       f"{page} a block_table row holds ({room} keys)")
                raise ValueError(msg)
        flash_args.check_pages(host_table, lengths, page, pages)
        table = block_table
        pools = k, v
    else:
        if cu_k[-1] > k.shape[0]:
            msg = (f"cu_seqlens_k must end at most at k.shape[0]={k.shape[0]}; got "
                   f"cu_seqlens_k[-1]={cu_k[-1]}")
            raise ValueError(msg)
        # Contiguous keys are pages of one token: key j of s is page cu_seqlens_k[s] + j.
        width = max(lengths, default=0)
        index = xp.int32 if k.shape[0] < 2**31 else xp.int64
        first = xp.reshape(xp.astype(cu_seqlens_k[:-1], index), (sequences, 1))
        j = xp.reshape(xp.arange(width, dtype=index, device=dev), (1, width))
        used = xp.reshape(xp.asarray(lengths, dtype=index, device=dev), (sequences, 1))
        table = xp.where(j < used, first + j, -1)
        pools = (xp.reshape(k, (k.shape[0], 1, *k.shape[1:])),
                 xp.reshape(v, (v.shape[0], 1, *v.shape[1:])))
    out, lse = _attend(xp, dev, q, *pools, table, lengths, cu_q, mask=mask,
                       scale=softmax_scale, softcap=cap, alibi_slopes=alibi_slopes)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None,
                            v: Any = None, rotary_cos: Any = None, rotary_sin: Any = None,
                            cache_seqlens: Any = None, cache_batch_idx: Any = None,
                            cache_leftpad: Any = None, block_table: Any = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Any = None,
                            num_splits: int = 0, return_softmax_lse: bool = False) -> Any:
    """Attention of queries to a key/value cache, as flash-attn's function.

    Batch element ``b`` holds ``cache_seqlens[b]`` keys: in row ``cache_batch_idx[b]``
    (else ``b``) of a ``(B_cache, L_cache, Hkv, D)`` cache, or in the pages
    ``block_table[b]`` of a paged one. New keys ``k`` and values ``v`` are first written
    into the cache after them, in place, as flash-attn does (``cache_seqlens`` itself
    is not advanced); the ``Lq`` queries then attend all ``cache_seqlens[b] + Lnew``
    keys, aligned to their end (query ``i`` at position ``cache_seqlens[b] + Lnew - Lq
    + i``). The result does not depend on ``num_splits``.

    Args:
        q: ``(B, Lq, Hq, D)``.
        k_cache: ``(B_cache, L_cache, Hkv, D)``, or with ``block_table`` the pool of
            pages ``(num_blocks, page_block_size, Hkv, D)``.
        v_cache: like ``k_cache``, with its own head dimension ``Dv``.
        k: None, or new keys ``(B, Lnew, Hkv, D)`` to write into ``k_cache`` (in place:
            arrays that cannot be written, JAX's, are refused).
        v: new values ``(B, Lnew, Hkv, Dv)``, given exactly when ``k`` is.
        rotary_cos: must be None: rotary embeddings are not applied here.
        rotary_sin: must be None.
        cache_seqlens: an int or integers ``(B,)``: the keys each element holds before
            ``k``; None for a full cache (``L_cache``, or ``W * page_block_size``).
        cache_batch_idx: integers ``(B,)``: the cache row of each element (no paging).
        cache_leftpad: must be None: left-padded caches are not supported here.
        block_table: integers ``(B, W)``: the pages of each element in order.
        softmax_scale: multiplies ``q @ k^T``; ``1/sqrt(D)`` when None.
        causal: a query attends the keys up to its position.
        window_size: ``(left, right)``, ``-1`` for unbounded, as in
            :func:`flash_attn_varlen_func`.
        softcap: scores become ``softcap * tanh(s / softcap)``; 0.0 for none.
        rotary_interleaved: accepted and ignored (no rotary embedding is applied).
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)``: ``-slope * |p - j|`` joins the scores.
        num_splits: accepted and ignored.
        return_softmax_lse: also return the log-sum-exp.

    Returns:
        ``out`` ``(B, Lq, Hq, Dv)``; with ``return_softmax_lse``, ``(out, lse)`` with
        ``lse`` ``(B, Hq, Lq)`` (float32 for half-precision ``q``).

    Raises:
        ValueError: shapes or lengths that do not fit, new keys that do not fit the
            cache or cannot be written into it, an argument that is not supported.
        TypeError: arrays of different dtypes, libraries or devices.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> from portattn.flash_attn import flash_attn_with_kvcache
        >>> rng = np.random.default_rng(0)
        >>> k_cache = np.zeros((2, 8, 1, 16), np.float32)            # room for 8 tokens
        >>> v_cache = np.zeros((2, 8, 1, 16), np.float32)
        >>> k_cache[:, :5] = v_cache[:, :5] = rng.standard_normal((2, 5, 1, 16))
        >>> q, k, v = (rng.standard_normal((2, 1, n, 16), dtype=np.float32)
        ...            for n in (4, 1, 1))
        >>> lengths = np.array([5, 3], np.int32)
        >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
        ...                               cache_seqlens=lengths, causal=True)
        >>> out.shape, bool(np.all(k_cache[1, 3] == k[1, 0]))    # written in place
        ((2, 1, 4, 16), True)
        >>> one = portattn.attention(q[1:], k_cache[1:, :4], v_cache[1:, :4], layout="blhd")
        >>> bool(np.allclose(out[1:], one, atol=1e-6))
        True
    """
    xp, dev = array_namespace(q), safe_device(q)
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_leftpad", cache_leftpad)):
        if value is not None:
            what = ("rotary embeddings are not applied here; rotate q and k before the"
                    " call" if name != "cache_leftpad" else "left-padded caches are not "
                    "supported here; hold each element's keys from position 0")
            msg = f"{name} must be None: {what}; got {name} of type {type(value).__name__}"
            raise ValueError(msg)
    mask = flash_args.window_mask(causal, window_size)
    cap = flash_args.softcap(softcap)
    int_at_least("num_splits", num_splits)  # flash-attn's tuning knob: nothing to tune here
    if (k is None) != (v is None):
        msg = (f"k and v must be given together; got k of type {type(k).__name__}, "
               f"v of type {type(v).__name__}")
        raise ValueError(msg)
    arrays = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    flash_args.check_arrays(xp, dev, *arrays, *([("k", k), ("v", v)] if k is not None else []))
    if q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape[:-1] != v_cache.shape[:-1]:
        msg = (f"q must be (B, Lq, Hq, D) and k_cache, v_cache 4-dimensional with one "
               f"shape but the last; got q.shape={tuple(q.shape)}, "
               f"k_cache.shape={tuple(k_cache.shape)}, v_cache.shape={tuple(v_cache.shape)}")
        raise ValueError(msg)
    flash_args.check_heads(q.shape[-2:], k_cache.shape[-2:], "q", "k_cache")
    batch, lq = q.shape[0], q.shape[1]
    flash_args.check_slopes(xp, dev, alibi_slopes, batch, q.shape[2])
    new = 0
    if k is not None:
        want = (batch, k.shape[1] if k.ndim == 4 else "Lnew", *k_cache.shape[2:])
        wantv = (*want[:3], v_cache.shape[3])
        if tuple(k.shape) != want or tuple(v.shape) != wantv:
            msg = (f"k and v must be (B, Lnew, Hkv, D) and (B, Lnew, Hkv, Dv) = {want} and "
                   f"{wantv}; got k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}")
            raise ValueError(msg)
        new = k.shape[1]
    pages, page = k_cache.shape[0], k_cache.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            msg = ("cache_batch_idx must be None with block_table (the table names each "
                   "element's pages)")
            raise ValueError(msg)
        host_table = flash_args.host_table(xp, dev, block_table, batch, "q.shape[0]")
        table = block_table
    else:  # a cache of B_cache rows is a pool of B_cache pages of L_cache tokens
        if cache_batch_idx is None:
            rows = list(range(batch))
            index = xp.arange(batch, dtype=xp.int32, device=dev)
        else:
            rows = host_ints(xp, dev, cache_batch_idx, "cache_batch_idx", (batch,), "q")
            index = cache_batch_idx
        bad = [r for r in rows if not 0 <= r < pages][:4]
        if bad and cache_batch_idx is None:
            msg = (f"q.shape[0]={batch} must be at most k_cache.shape[0]={pages} without "
                   f"cache_batch_idx")
            raise ValueError(msg)
        if bad:
            msg = (f"cache_batch_idx must name rows of k_cache in [0, {pages}); got "
                   f"cache_batch_idx={flash_args.short(rows)} (outside: {bad})")
            raise ValueError(msg)
        host_table = [[r] for r in rows]
        table = xp.reshape(index, (batch, 1))
    capacity = page * (len(host_table[0]) if host_table else 0)
    held = flash_args.cache_lengths(xp, dev, cache_seqlens, batch, capacity, new)
    lengths = [n + new for n in held]
    flash_args.check_pages(host_table, lengths, page, pages)
    if new:
        slots = [(host_table[b][p // page], p % page)
                 for b in range(batch) for p in range(held[b], lengths[b])]
        if len(set(slots)) != len(slots):
            twice = next(x for x in slots if slots.count(x) > 1)
            msg = (f"k and v would write one cache slot twice (page {twice[0]}, offset "
                   f"{twice[1]}): two elements share a page (block_table) or a row "
                   f"(cache_batch_idx) where the new keys go")
            raise ValueError(msg)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not is_writeable_array(cache):
                msg = (f"{name} cannot be written in place ({type(cache).__module__}."
                       f"{type(cache).__name__} is immutable or read-only), and k, v are "
                       f"written into it as flash-attn does; append with "
                       f"portattn.PagedKVCache or portattn.KVCache, or write the cache "
                       f"yourself and pass k=None, v=None")
                raise ValueError(msg)
        _write(xp, dev, k_cache, k, slots, "k_cache")
        _write(xp, dev, v_cache, v, slots, "v_cache")
    starts = [b * lq for b in range(batch + 1)]
    query = xp.reshape(q, (batch * lq, *q.shape[2:]))
    out, lse = _attend(xp, dev, query, k_cache, v_cache, table, lengths, starts, mask=mask,
                       scale=softmax_scale, softcap=cap, alibi_slopes=alibi_slopes)
    out = xp.reshape(out, (batch, lq, *out.shape[1:]))
    if not return_softmax_lse:
        return out
    return out, xp.permute_dims(xp.reshape(lse, (lse.shape[0], batch, lq)), (1, 0, 2))


def _attend(xp: Any, dev: Any, query: Any, key_pages: Any, value_pages: Any, table: Any,
            lengths: list[int], starts: list[int], *, mask: Mask | None,
            scale: float | None, softcap: float | None,
            alibi_slopes: Any) -> tuple[Any, Any]:
    """``(out (T, Hq, Dv), lse (Hq, T))``. A sequence with more queries than keys has
    queries before its first key, which paged attention has no place for: it is
    attended on its own, its keys gathered."""
    sequences = len(lengths)
    options = {"mask": mask, "scale": scale, "softcap": softcap}
    over = [s for s in range(sequences) if starts[s + 1] - starts[s] > lengths[s]]

    def ints(values: list[int]) -> Any:
        return xp.asarray(values, dtype=xp.int32, device=dev)

    if not over:
        return paged_attention(query, key_pages, value_pages, block_table=table,
                               key_lengths=ints(lengths), query_starts=ints(starts),
                               alibi_slopes=alibi_slopes, return_lse=True, **options)
    outs, lses, order = [], [], []
    kept = [s for s in range(sequences) if s not in over]
    rows = [r for s in kept for r in range(starts[s], starts[s + 1])]
    if rows:
        main_starts = [0]
        for s in range(sequences):
            main_starts.append(main_starts[-1] + (0 if s in over else
                                                  starts[s + 1] - starts[s]))
        out, lse = paged_attention(xp.take(query, ints(rows), axis=0), key_pages,
                                   value_pages, block_table=table,
                                   key_lengths=ints(lengths), query_starts=ints(main_starts),
                                   alibi_slopes=alibi_slopes, return_lse=True, **options)
        outs.append(out)
        lses.append(lse)
        order.extend(rows)
    for s in over:
        keys, values = (_gathered(xp, dev, pool, table[s, ...], lengths[s])
                        for pool in (key_pages, value_pages))
        slopes = alibi_slopes
        if slopes is not None and slopes.ndim == 2:
            slopes = slopes[s, ...]
        out, lse = attention(xp.expand_dims(query[starts[s]:starts[s + 1], ...], axis=0),
                             xp.expand_dims(keys, axis=0), xp.expand_dims(values, axis=0),
                             alibi_slopes=slopes, return_lse=True, layout="blhd",
                             **options)
        outs.append(out[0, ...])
        lses.append(lse[0, ...])
        order.extend(range(starts[s], starts[s + 1]))
    where = [0] * len(order)
    for index, row in enumerate(order):
        where[row] = index
    pick = ints(where)
    return (xp.take(xp.concat(outs, axis=0), pick, axis=0),
            xp.take(xp.concat(lses, axis=1), pick, axis=1))


def _gathered(xp: Any, dev: Any, pool: Any, pages: Any, length: int) -> Any:
    """The first ``length`` tokens ``(length, Hkv, D)`` held in ``pages`` of ``pool``."""
    page = pool.shape[1]
    wide = xp.int64 if pool.shape[0] * page >= 2**31 else xp.int32
    used = pages[:-(-length // page)]
    slots = (xp.reshape(xp.astype(used, wide), (-1, 1)) * page
             + xp.reshape(xp.arange(page, dtype=wide, device=dev), (1, page)))
    rows = xp.reshape(pool, (-1, *pool.shape[2:]))
    return xp.take(rows, xp.reshape(slots, (-1,))[:length], axis=0)


def _write(xp: Any, dev: Any, cache: Any, new: Any, slots: list[tuple[int, int]],
           name: str) -> None:
    """Write the tokens of ``new`` ``(B, Lnew, H, D)`` at ``slots`` (page, offset) of
    ``cache`` in place, and check that they are there."""
    from array_api_extra import at

    tokens = xp.reshape(new, (-1, *new.shape[2:]))
    pages = xp.asarray([p for p, _ in slots], dtype=xp.int64, device=dev)
    offsets = xp.asarray([o for _, o in slots], dtype=xp.int64, device=dev)
    try:
        at(cache)[pages, offsets].set(tokens, copy=False)
    except (IndexError, NotImplementedError):  # no pairs of index arrays in __setitem__
        # (array-api-strict, Dask): one slice per run of slots in a page
        steps = new.shape[1]
        for t, (p, o) in enumerate(slots):
            b, i = divmod(t, steps)
            if i and slots[t - 1] == (p, o - 1):
                continue  # written with the run that starts before it
            run = 1
            while i + run < steps and slots[t + run] == (p, o + run):
                run += 1
            at(cache)[p, o:o + run, ...].set(new[b, i:i + run, ...], copy=False)
    rows = xp.reshape(cache, (-1, *cache.shape[2:]))
    page = cache.shape[1]
    there = xp.take(rows, pages * page + offsets, axis=0)
    same = (there == tokens) | (xp.isnan(there) & xp.isnan(tokens))
    if not bool(xp.all(same)):
        msg = (f"{name} was not updated in place (its library made a copy); pass a "
               f"writeable, contiguous {name}, or write the cache yourself and pass "
               f"k=None, v=None")
        raise ValueError(msg)

