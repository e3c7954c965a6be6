"""A key/value cache in pages, for serving many sequences at once.

Keys and values live in a pool of fixed-size pages; each sequence owns a list of pages
(its block table row) and a length. Pages are taken from the pool as sequences grow and
given back when they end, so memory follows the tokens held, not the batch times the
longest sequence. The pool grows (doubling) when it runs out.

Sequences may share pages: :meth:`PagedKVCache.fork` starts a sequence from another's
tokens without copying them (a prompt sampled n times, beams). A page shared by several
sequences is never written: a sequence that appends to a shared, partly filled last
page first takes its own copy of it (copy on write).

Writes are functional updates (``array_api_extra.at``): in place on mutable arrays,
new arrays on JAX. The bookkeeping (tables, lengths, reference counts) is plain Python
on the host, as in every serving engine.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

from array_api_compat import array_namespace

from ._kernels import with_rows
from ._lib import check_like, dtype_name, namespace, resolve_dtype, safe_device
from ._models import int_at_least
from .paged import LAYOUTS, paged_attention

__all__ = ["PagedKVCache", "PagedStep"]


class PagedKVCache:
    """Pages of keys ``(P, page, Hkv, D)`` and values ``(P, page, Hkv, Dv)`` (or
    ``(P, Hkv, page, ...)`` with ``layout="bhld"``) and the sequences that use them.

    Make one with :meth:`empty`. A sequence is an int from :meth:`add` or :meth:`fork`;
    :meth:`append` writes new tokens of several sequences at once, :meth:`attention`
    attends packed queries of several sequences to their keys, :meth:`free` ends one.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> cache = portattn.PagedKVCache.empty(4, 2, 8)            # pages of 4 tokens
        >>> rng = np.random.default_rng(0)
        >>> k, v, q = (rng.standard_normal((9, 2, 8), dtype=np.float32) for _ in range(3))
        >>> a, b = cache.add(), cache.add()
        >>> cache.append([a, b], k[:7], v[:7], counts=[5, 2])      # two prompts, packed
        >>> out = cache.attention(q[:7], [a, b], counts=[5, 2], mask=masks.causal())
        >>> c = cache.fork(a)                     # shares a's pages: a prompt sampled twice
        >>> cache.append([a, c], k[7:], v[7:])                       # one token each
        >>> [cache.length(s) for s in (a, b, c)], cache.pages_in_use
        ([6, 2, 6], 4)
        >>> step = cache.attention(q[7:], [a, c], mask=masks.causal())
        >>> step.shape
        (2, 2, 8)
    """

    def __init__(self, key_pages: Any, value_pages: Any, *, layout: str = "blhd") -> None:
        if layout not in LAYOUTS:
            msg = f"layout must be one of {LAYOUTS}; got layout={layout!r}"
            raise ValueError(msg)
        xp = array_namespace(key_pages)
        check_like(xp, safe_device(key_pages), value_pages, "value_pages", "key_pages")
        k, v = tuple(key_pages.shape), tuple(value_pages.shape)
        if len(k) != 4 or k[:3] != v[:3]:
            msg = (f"key_pages and value_pages must be 4-dimensional pools with the same "
                   f"first three sizes; got key_pages.shape={k}, value_pages.shape={v}")
            raise ValueError(msg)
        if key_pages.dtype != value_pages.dtype:
            msg = (f"key_pages and value_pages must share one dtype; got "
                   f"{dtype_name(key_pages.dtype)} and {dtype_name(value_pages.dtype)}")
            raise TypeError(msg)
        self._xp = xp
        self._layout = layout
        self.key_pages = key_pages
        self.value_pages = value_pages
        self._refs = [0] * k[0]  # sequences holding each page
        self._free = list(range(k[0] - 1, -1, -1))  # a stack: the lowest page first
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next = 0

    @classmethod
    def empty(cls, page_size: int, num_kv_heads: int, head_dim: int, *,
              value_head_dim: int | None = None, num_pages: int = 16,
              layout: str = "blhd", xp: Any = None, dtype: Any = "float32",
              device: Any = None) -> PagedKVCache:
        """A cache with ``num_pages`` pages of zeros and no sequence.

        Args:
            page_size: tokens per page.
            num_kv_heads: key/value heads ``Hkv``.
            head_dim: key head dimension ``D``.
            value_head_dim: value head dimension ``Dv``; ``head_dim`` when None.
            num_pages: pages to start with; the pool doubles when they run out.
            layout: ``"blhd"`` for pages ``(page, Hkv, D)``, ``"bhld"`` for
                ``(Hkv, page, D)``.
            xp: the array namespace; NumPy when None.
            dtype: a dtype or its name.
            device: where to allocate; the library's default when None.

        Returns:
            The empty :class:`PagedKVCache`.

        Raises:
            ValueError: a size is not an int, or is below 1.

        Example:
            >>> from portattn import PagedKVCache
            >>> cache = PagedKVCache.empty(16, 2, 64, num_pages=8, layout="bhld")
            >>> cache.key_pages.shape, cache.pages_in_use
            ((8, 2, 16, 64), 0)
        """
        xp = namespace(xp)
        page = int_at_least("page_size", page_size, 1)
        heads = int_at_least("num_kv_heads", num_kv_heads, 1)
        dim = int_at_least("head_dim", head_dim, 1)
        vdim = dim if value_head_dim is None else int_at_least("value_head_dim",
                                                                 value_head_dim, 1)
        pages = int_at_least("num_pages", num_pages, 1)
        dt = resolve_dtype(xp, dtype)
        kwargs = {} if device is None else {"device": device}

        def pool(d: int) -> Any:
            shape = (pages, heads, page, d) if layout == "bhld" else (pages, page, heads, d)
            return xp.zeros(shape, dtype=dt, **kwargs)

        return cls(pool(dim), pool(vdim), layout=layout)

    @property
    def layout(self) -> str:
        """``"blhd"`` or ``"bhld"``: how a page holds its tokens and heads."""
        return self._layout

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.key_pages.shape[2 if self._layout == "bhld" else 1]

    @property
    def num_pages(self) -> int:
        """Pages in the pool, used or not."""
        return self.key_pages.shape[0]

    @property
    def pages_in_use(self) -> int:
        """Pages some sequence holds (a shared page counts once)."""
        return sum(1 for r in self._refs if r)

    @property
    def sequences(self) -> list[int]:
        """The live sequences, oldest first."""
        return list(self._pages)

    def add(self) -> int:
        """A new, empty sequence; returns its id."""
        seq = self._next
        self._next += 1
        self._pages[seq] = []
        self._lengths[seq] = 0
        return seq

    def fork(self, sequence: int) -> int:
        """A new sequence holding ``sequence``'s tokens, sharing its pages.

        The two grow apart from here: the first to append to a shared page that is
        not full writes into its own copy of it.
        """
        pages = self._pages_of(sequence)
        seq = self.add()
        self._pages[seq] = list(pages)
        self._lengths[seq] = self._lengths[sequence]
        for p in pages:
            self._refs[p] += 1
        return seq

    def free(self, sequence: int) -> None:
        """End ``sequence``: its pages go back to the pool unless another holds them."""
        for p in self._pages_of(sequence):
            self._refs[p] -= 1
            if not self._refs[p]:
                self._free.append(p)
        del self._pages[sequence], self._lengths[sequence]

    def length(self, sequence: int) -> int:
        """Tokens ``sequence`` holds."""
        self._pages_of(sequence)
        return self._lengths[sequence]

    def append(self, sequences: Sequence[int], key: Any, value: Any,
               counts: Sequence[int] | None = None) -> None:
        """Write new tokens of several sequences, packed end to end.

        Args:
            sequences: the sequences, each at most once.
            key: ``(T, Hkv, D)``: ``counts[0]`` tokens of ``sequences[0]``, then
                ``counts[1]`` of ``sequences[1]``, ...
            value: ``(T, Hkv, Dv)``, the same way.
            counts: tokens per sequence, summing to ``T``; one each when None.

        Raises:
            ValueError: shapes that do not fit the cache, counts that do not sum to
                ``T``, an unknown or repeated sequence (nothing is written).
            TypeError: a dtype, library or device that differs from the cache's.
        """
        counts = self._counts(sequences, counts, key, value)
        slots: list[int] = []
        for seq, n in zip(sequences, counts, strict=True):
            slots.extend(self._grow(seq, n))
        if not slots:
            return
        self.key_pages = self._write(self.key_pages, slots, key)
        self.value_pages = self._write(self.value_pages, slots, value)

    def step(self, sequences: Sequence[int], counts: Sequence[int] | None = None) -> PagedStep:
        """One forward pass over these sequences' new tokens, packed end to end: the
        ``cache=`` of :class:`portattn.MultiHeadAttention` (each layer's own cache).

        Args:
            sequences: the sequences, each at most once.
            counts: tokens per sequence in the pass; one each when None.

        Returns:
            The :class:`PagedStep`, whose :meth:`~PagedStep.append` and
            :meth:`~PagedStep.attention` read the packed tokens that way.

        Example:
            >>> import numpy as np
            >>> from portattn import MultiHeadAttention, masks
            >>> layer = MultiHeadAttention.init(16, 4, 2)
            >>> cache = layer.new_paged_cache(page_size=8)
            >>> a, b = cache.add(), cache.add()
            >>> x = np.ones((7, 16), dtype=np.float32)       # 5 tokens of a, 2 of b
            >>> layer(x, mask=masks.causal(), cache=cache.step([a, b], [5, 2])).shape
            (7, 16)
            >>> cache.length(a), cache.length(b)
            (5, 2)
        """
        seqs = tuple(operator.index(s) for s in sequences)
        for seq in seqs:
            self._pages_of(seq)  # an unknown sequence is named now, not in a layer
        return PagedStep(self, seqs, None if counts is None else
                         tuple(operator.index(n) for n in counts))

    def block_table(self, sequences: Sequence[int]) -> Any:
        """``(S, W)`` int32: the pages of each sequence in order, ``-1`` past its end
        (``W``: the most pages any of them holds)."""
        rows = [self._pages_of(s) for s in sequences]
        width = max((len(r) for r in rows), default=0)
        table = [r + [-1] * (width - len(r)) for r in rows]
        xp = self._xp
        dev = safe_device(self.key_pages)
        if width == 0:
            return xp.zeros((len(rows), 0), dtype=xp.int32, device=dev)
        return xp.asarray(table, dtype=xp.int32, device=dev)

    def key_lengths(self, sequences: Sequence[int]) -> Any:
        """``(S,)`` int32: the tokens each sequence holds."""
        lengths = [self.length(s) for s in sequences]
        return self._xp.asarray(lengths, dtype=self._xp.int32,
                                device=safe_device(self.key_pages))

    def attention(self, query: Any, sequences: Sequence[int],
                  counts: Sequence[int] | None = None, **options: Any) -> Any:
        """:func:`portattn.paged_attention` of packed queries to these sequences' keys.

        Args:
            query: ``(T, Hq, D)``: ``counts[i]`` queries of ``sequences[i]`` after
                another, which are its last positions (append their keys first).
            sequences: the sequences.
            counts: queries per sequence; one each when None.
            **options: ``mask``, ``scale``, ``softcap``, ``alibi_slopes``, ``sinks``,
                ``return_lse``, as :func:`portattn.paged_attention` takes them.

        Returns:
            What :func:`portattn.paged_attention` returns.
        """
        starts = None
        if counts is not None:
            total = [0]
            for n in counts:
                total.append(total[-1] + operator.index(n))
            starts = self._xp.asarray(total, dtype=self._xp.int32,
                                      device=safe_device(self.key_pages))
        return paged_attention(query, self.key_pages, self.value_pages,
                               block_table=self.block_table(sequences),
                               key_lengths=self.key_lengths(sequences),
                               query_starts=starts, layout=self._layout, **options)

    def _pages_of(self, sequence: int) -> list[int]:
        pages = self._pages.get(sequence)
        if pages is None:
            msg = (f"sequence {sequence!r} is not in the cache (live: "
                   f"{self.sequences[:8]})")
            raise ValueError(msg)
        return pages

    def _counts(self, sequences: Sequence[int], counts: Sequence[int] | None, key: Any,
                value: Any) -> list[int]:
        """The checked counts; nothing is changed before every check passed."""
        xp = self._xp
        for name, new, pool in (("key", key, self.key_pages),
                                ("value", value, self.value_pages)):
            check_like(xp, safe_device(pool), new, name, "the cache")
            heads = pool.shape[1 if self._layout == "bhld" else 2]
            want = ("T", heads, pool.shape[-1])
            if len(new.shape) != 3 or tuple(new.shape[1:]) != want[1:]:
                msg = f"{name} must have shape {want}; got {name}.shape={tuple(new.shape)}"
                raise ValueError(msg)
            if new.dtype != pool.dtype:
                msg = (f"{name}.dtype={dtype_name(new.dtype)} differs from the cache's "
                       f"dtype {dtype_name(pool.dtype)}")
                raise TypeError(msg)
        if len(set(sequences)) != len(sequences):
            msg = f"each sequence may appear once; got sequences={list(sequences)}"
            raise ValueError(msg)
        for s in sequences:
            self._pages_of(s)
        counts = [1] * len(sequences) if counts is None else [
            int_at_least("counts[i]", n) for n in counts]
        total = key.shape[0]
        if len(counts) != len(sequences) or sum(counts) != total or value.shape[0] != total:
            msg = (f"counts must give one number per sequence, summing to key.shape[0] "
                   f"== value.shape[0]; got counts={counts} for {len(sequences)} "
                   f"sequences, key.shape[0]={total}, value.shape[0]={value.shape[0]}")
            raise ValueError(msg)
        return counts

    def _grow(self, seq: int, n: int) -> list[int]:
        """The slots (``page * page_size + offset``) of ``seq``'s next ``n`` tokens,
        taking pages as needed and copying a shared last page before writing to it."""
        page = self.page_size
        pages, length = self._pages[seq], self._lengths[seq]
        if n and length % page and self._refs[pages[-1]] > 1:
            pages[-1] = self._copy_of(pages[-1])
        slots = []
        for position in range(length, length + n):
            if position // page == len(pages):
                pages.append(self._take())
            slots.append(pages[position // page] * page + position % page)
        self._lengths[seq] = length + n
        return slots

    def _take(self) -> int:
        if not self._free:
            self._double()
        p = self._free.pop()
        self._refs[p] = 1
        return p

    def _copy_of(self, shared: int) -> int:
        """A page of this sequence's own with ``shared``'s contents."""
        self._refs[shared] -= 1
        p = self._take()
        xp = self._xp
        for name in ("key_pages", "value_pages"):  # a copy: the source is a view of the pool
            pool = getattr(self, name)
            page = xp.asarray(pool[shared:shared + 1, ...], copy=True)
            setattr(self, name, _put(xp, pool, [p], page))
        return p

    def _double(self) -> None:
        xp = self._xp
        n = self.num_pages
        self.key_pages = xp.concat([self.key_pages, xp.zeros_like(self.key_pages)], axis=0)
        self.value_pages = xp.concat([self.value_pages, xp.zeros_like(self.value_pages)],
                                     axis=0)
        self._refs.extend([0] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def _write(self, pool: Any, slots: list[int], new: Any) -> Any:
        """``pool`` with token ``t`` of ``new`` at ``slots[t]``."""
        xp = self._xp
        shape = tuple(pool.shape)
        if self._layout == "bhld":  # (P, Hkv, page, D): one row per (page, head, offset)
            heads, page = shape[1], shape[2]
            where = [((s // page) * heads + h) * page + s % page
                     for s in slots for h in range(heads)]
        else:  # (P, page, Hkv, D): one row per (slot, head)
            heads = shape[2]
            where = [s * heads + h for s in slots for h in range(heads)]
        rows = _put(xp, xp.reshape(pool, (-1, shape[-1])), where,
                    xp.reshape(new, (-1, shape[-1])))
        return xp.reshape(rows, shape)

    def __repr__(self) -> str:
        heads = self.key_pages.shape[1 if self._layout == "bhld" else 2]
        return (f"PagedKVCache(pages={self.num_pages}, page_size={self.page_size}, "
                f"heads={heads}, head_dim={self.key_pages.shape[-1]}, "
                f"value_head_dim={self.value_pages.shape[-1]}, layout={self._layout!r}, "
                f"sequences={len(self._pages)}, pages_in_use={self.pages_in_use}, "
                f"dtype={dtype_name(self.key_pages.dtype)})")


class PagedStep(NamedTuple):
    """One forward pass's tokens in a :class:`PagedKVCache` (:meth:`PagedKVCache.step`):
    ``counts[i]`` packed tokens of ``sequences[i]`` after another (one each when
    ``counts`` is None)."""

    cache: PagedKVCache
    sequences: tuple[int, ...]
    counts: tuple[int, ...] | None

    def append(self, key: Any, value: Any) -> None:
        """Write the pass's keys ``(T, Hkv, D)`` and values ``(T, Hkv, Dv)``."""
        self.cache.append(self.sequences, key, value, self.counts)

    def attention(self, query: Any, **options: Any) -> Any:
        """The pass's queries ``(T, Hq, D)`` attended to their sequences' keys (append
        first): :meth:`PagedKVCache.attention`."""
        return self.cache.attention(query, self.sequences, self.counts, **options)


def _put(xp: Any, whole: Any, rows: list[int], new: Any) -> Any:
    """``whole`` with ``new[i]`` as its row ``rows[i]`` (axis 0): in place where the
    library writes through an index array, else (array-api-strict) by a gather."""
    from array_api_extra import at

    index = xp.asarray(rows, dtype=xp.int32, device=safe_device(whole))
    try:
        return at(whole)[index].set(new)
    except IndexError:  # no assignment through an index array
        return with_rows(xp, whole, rows, new)
