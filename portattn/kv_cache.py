"""A key/value cache for autoregressive decoding.

The cache preallocates ``capacity`` positions for keys and values and fills them step
by step. Each :meth:`KVCache.append` writes the new positions with a functional update
(``array_api_extra.at``), so it works on immutable arrays (JAX) as well as on mutable
ones (where the write happens in place), and returns the keys and values filled so far.

Attending the new queries to those keys with the bottom-right aligned
:func:`portattn.masks.causal` places query ``i`` of ``n`` new tokens at absolute position
``length - n + i``: decoding one token at a time gives exactly the rows of one causal
pass over the whole sequence.

A *ragged* cache (:meth:`KVCache.ragged`) keeps one length per sequence, as batched
decoding of prompts of different lengths needs: sequence ``b``'s new positions are
written at ``lengths[b]``, and :meth:`KVCache.mask` aligns the causal mask to each
sequence's own length (:func:`portattn.masks.sequence_causal`).
"""

from __future__ import annotations

import math
from typing import Any

from array_api_compat import array_namespace

from ._lib import check_like, dtype_name, namespace, resolve_dtype, safe_device
from ._models import int_at_least

__all__ = ["KVCache"]


class KVCache:
    """Keys ``(*batch, Hkv, capacity, D)`` and values ``(*batch, Hkv, capacity, Dv)``.

    One cache serves one attention layer; all batch elements share one length (a
    :meth:`ragged` cache keeps one per sequence). Use :meth:`empty` (or
    ``MultiHeadAttention.new_cache``) to make one. Pickling and ``copy.deepcopy``
    work (to send a cache to another process, or branch it for beam search).

    Args:
        key_buffer: ``(*batch, Hkv, capacity, D)``; the cache writes into it.
        value_buffer: ``(*batch, Hkv, capacity, Dv)``, same library, device and dtype.
        length: positions already filled, in ``[0, capacity]``.

    Raises:
        ValueError: the shapes do not fit together, or ``length`` is out of range.
        TypeError: the buffers differ in dtype, library or device.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> cache = portattn.KVCache.empty(1, 2, 4, capacity=16)
        >>> rng = np.random.default_rng(0)
        >>> k = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> v = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> q = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> keys, values = cache.append(k[..., :6, :], v[..., :6, :])   # the prompt
        >>> keys, values = cache.append(k[..., 6:7, :], v[..., 6:7, :])  # one new token
        >>> keys.shape, cache.length
        ((1, 2, 7, 4), 7)
        >>> step = portattn.attention(q[..., 6:7, :], keys, values, mask=cache.mask(1))
        >>> full = portattn.attention(q[..., :7, :], k[..., :7, :], v[..., :7, :],
        ...                           mask=masks.causal())
        >>> bool(np.allclose(step, full[..., 6:7, :], atol=1e-6))
        True
    """

    def __init__(self, key_buffer: Any, value_buffer: Any, length: int = 0) -> None:
        xp = array_namespace(key_buffer)
        check_like(xp, safe_device(key_buffer), value_buffer, "value_buffer", "key_buffer")
        k, v = tuple(key_buffer.shape), tuple(value_buffer.shape)
        if len(k) < 3 or k[:-1] != v[:-1]:
            msg = (f"key_buffer and value_buffer must have shapes (*batch, Hkv, capacity, D) "
                   f"and (*batch, Hkv, capacity, Dv); got key_buffer.shape={k}, "
                   f"value_buffer.shape={v}")
            raise ValueError(msg)
        if key_buffer.dtype != value_buffer.dtype:
            msg = (f"key_buffer and value_buffer must share one dtype; got "
                   f"{dtype_name(key_buffer.dtype)} and {dtype_name(value_buffer.dtype)}")
            raise TypeError(msg)
        length = int_at_least("length", length)
        if length > k[-2]:
            msg = f"length must lie in [0, capacity={k[-2]}]; got length={length}"
            raise ValueError(msg)
        self._xp = xp
        self._key = key_buffer
        self._value = value_buffer
        self._length = length
        self._lengths: Any = None  # per-sequence lengths of a ragged cache

    def __getstate__(self) -> dict[str, Any]:
        # The array module is found again from the buffers: pickling sends a cache to
        # another process, deepcopy branches it (beam search).
        return {name: value for name, value in self.__dict__.items() if name != "_xp"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._xp = array_namespace(self._key)

    @classmethod
    def ragged(cls, key_buffer: Any, value_buffer: Any, lengths: Any) -> KVCache:
        """A cache whose sequence ``b`` holds its first ``lengths[b]`` positions.

        :meth:`append` then writes sequence ``b``'s new positions at ``lengths[b]``,
        and :meth:`mask` aligns the causal mask to each sequence's own length.

        Args:
            key_buffer: ``(*batch, Hkv, capacity, D)``.
            value_buffer: ``(*batch, Hkv, capacity, Dv)``.
            lengths: integer array with the batch shape, values in ``[0, capacity]``;
                read once here (the longest sequence sets how many positions
                :attr:`keys` returns).

        Returns:
            The ragged cache.

        Raises:
            ValueError: ``lengths`` is not an integer array of the batch shape, or a
                value lies outside ``[0, capacity]``.

        Example:
            >>> import numpy as np
            >>> from portattn import KVCache, masks
            >>> buf = np.zeros((2, 1, 8, 4), dtype=np.float32)
            >>> cache = KVCache.ragged(buf, buf.copy(), np.array([3, 5]))
            >>> cache.length, cache.keys.shape
            (5, (2, 1, 5, 4))
            >>> new = np.ones((2, 1, 1, 4), dtype=np.float32)
            >>> keys, values = cache.append(new, new)
            >>> cache.lengths.tolist(), keys.shape
            ([4, 6], (2, 1, 6, 4))
            >>> print(masks.text(cache.mask(1), 1, 6, batch=0))
            ####..
        """
        cache = cls(key_buffer, value_buffer)
        xp = cache._xp
        batch = tuple(key_buffer.shape[:-3])
        if not hasattr(lengths, "shape") or not xp.isdtype(lengths.dtype, "integral") \
                or tuple(lengths.shape) != batch:
            shape = tuple(getattr(lengths, "shape", ()))
            msg = (f"lengths must be an integer array of the batch shape {batch}; got "
                   f"lengths of type {type(lengths).__name__} with shape {shape}")
            raise ValueError(msg)
        some = math.prod(batch) > 0
        low = int(xp.min(lengths)) if some else 0
        high = int(xp.max(lengths)) if some else 0
        if low < 0 or high > cache.capacity:
            msg = (f"lengths must lie in [0, capacity={cache.capacity}]; got lengths with "
                   f"min={low}, max={high}")
            raise ValueError(msg)
        cache._lengths = xp.astype(lengths, xp.int64)
        cache._length = high
        return cache

    @property
    def lengths(self) -> Any:
        """Per-sequence lengths ``(*batch)`` of a ragged cache; None otherwise."""
        return self._lengths

    def mask(self, num_queries: int) -> Any:
        """The mask for ``num_queries`` new queries against :attr:`keys`.

        Args:
            num_queries: how many new queries attend (the positions just appended).

        Returns:
            ``masks.causal()`` (bottom-right aligned); for a ragged cache
            ``masks.sequence_causal``, aligned to each sequence's own length, with its
            padding past ``lengths[b]`` hidden.

        Example:
            >>> from portattn import KVCache, masks
            >>> cache = KVCache.empty(1, 1, 4, capacity=8)
            >>> print(masks.text(cache.mask(2), 2, 5))
            ####.
            #####
        """
        from . import masks

        if self._lengths is None:
            return masks.causal()
        queries = self._xp.full(self._lengths.shape, num_queries, dtype=self._lengths.dtype,
                                device=safe_device(self._lengths))
        return masks.sequence_causal(queries, self._lengths)

    @classmethod
    def empty(cls, batch_shape: int | tuple[int, ...], num_kv_heads: int, head_dim: int,
              capacity: int, *, value_head_dim: int | None = None, xp: Any = None,
              dtype: Any = "float32", device: Any = None) -> KVCache:
        """An empty cache (length 0) of zeros.

        Args:
            batch_shape: the batch dims, an int or a tuple (``()`` for none).
            num_kv_heads: key/value heads ``Hkv``.
            head_dim: key head dimension ``D``.
            capacity: positions to hold, at least 1.
            value_head_dim: value head dimension ``Dv``; defaults to ``head_dim``.
            xp: the array namespace; NumPy when None.
            dtype: a dtype or its name.
            device: where to allocate; the library's default when None.

        Returns:
            A :class:`KVCache` with keys ``(*batch, Hkv, capacity, D)`` and values
            ``(*batch, Hkv, capacity, Dv)``.

        Raises:
            ValueError: a size is not an int, or is below its minimum.

        Example:
            >>> from portattn import KVCache
            >>> KVCache.empty((2,), 4, 8, capacity=32, value_head_dim=16)
            KVCache(shape=(2, 4, 32, 8), value_head_dim=16, length=0, dtype=float32)
        """
        xp = namespace(xp)
        batch = (batch_shape,) if isinstance(batch_shape, int) else tuple(batch_shape)
        for i, b in enumerate(batch):
            int_at_least(f"batch_shape[{i}]", b)
        heads = int_at_least("num_kv_heads", num_kv_heads, low=1)
        dim = int_at_least("head_dim", head_dim, low=1)
        vdim = dim if value_head_dim is None else int_at_least("value_head_dim",
                                                                 value_head_dim, low=1)
        cap = int_at_least("capacity", capacity, low=1)
        dt = resolve_dtype(xp, dtype)
        kwargs = {} if device is None else {"device": device}
        key = xp.zeros((*batch, heads, cap, dim), dtype=dt, **kwargs)
        value = xp.zeros((*batch, heads, cap, vdim), dtype=dt, **kwargs)
        return cls(key, value)

    @property
    def capacity(self) -> int:
        """Positions the buffers hold."""
        return self._key.shape[-2]

    @property
    def length(self) -> int:
        """Positions filled so far (a ragged cache: by its longest sequence)."""
        return self._length

    @property
    def keys(self) -> Any:
        """The keys filled so far, ``(*batch, Hkv, length, D)``."""
        return self._key[..., :self._length, :]

    @property
    def values(self) -> Any:
        """The values filled so far, ``(*batch, Hkv, length, Dv)``."""
        return self._value[..., :self._length, :]

    def append(self, key: Any, value: Any) -> tuple[Any, Any]:
        """Store ``n`` new positions; return all keys and values filled so far.

        Args:
            key: ``(*batch, Hkv, n, D)``, in the cache's library, device and dtype.
            value: ``(*batch, Hkv, n, Dv)``.

        Returns:
            ``(keys, values)``: :attr:`keys` and :attr:`values` after the write.

        Raises:
            ValueError: the shapes do not fit the cache, or the cache has no room for
                ``n`` more positions (nothing is written).
            TypeError: a dtype, library or device differs from the cache's.

        Example:
            >>> import numpy as np
            >>> from portattn import KVCache
            >>> cache = KVCache.empty(1, 2, 4, capacity=4)
            >>> new = np.ones((1, 2, 3, 4), dtype=np.float32)
            >>> keys, values = cache.append(new, new)
            >>> keys.shape
            (1, 2, 3, 4)
            >>> try:
            ...     cache.append(new, new)
            ... except ValueError as e:
            ...     print(str(e).split(";")[0])
            KVCache overflow: appending 3 positions at length=3 needs 6 > capacity=4
        """
        from array_api_extra import at

        for name, new, buf in (("key", key, self._key), ("value", value, self._value)):
            check_like(self._xp, safe_device(buf), new, name, "the cache")
            want = (*buf.shape[:-2], buf.shape[-1])
            got = tuple(new.shape)
            if len(got) != len(buf.shape) or (*got[:-2], got[-1]) != want:
                shape = (*buf.shape[:-2], "n", buf.shape[-1])
                msg = (f"{name} must have shape {shape} to fit the cache; "
                       f"got {name}.shape={got}")
                raise ValueError(msg)
            if new.dtype != buf.dtype:
                msg = (f"{name}.dtype={dtype_name(new.dtype)} differs from the cache's dtype "
                       f"{dtype_name(buf.dtype)}")
                raise TypeError(msg)
        n = key.shape[-2]
        if value.shape[-2] != n:
            msg = (f"key and value must add the same number of positions; got "
                   f"key.shape[-2]={n}, value.shape[-2]={value.shape[-2]}")
            raise ValueError(msg)
        start, stop = self._length, self._length + n
        if stop > self.capacity:
            msg = (f"KVCache overflow: appending {n} positions at length={start} needs "
                   f"{stop} > capacity={self.capacity}; make the cache larger")
            raise ValueError(msg)
        if self._lengths is not None:
            return self._append_ragged(key, value, n)
        self._key = at(self._key)[..., start:stop, :].set(key)
        self._value = at(self._value)[..., start:stop, :].set(value)
        self._length = stop
        return self.keys, self.values

    def _append_ragged(self, key: Any, value: Any, n: int) -> tuple[Any, Any]:
        """Sequence ``b``'s ``n`` positions written at ``lengths[b]`` onwards: one
        masked select per new position (functional, so immutable arrays work too)."""
        xp = self._xp
        slots = xp.arange(self.capacity, device=safe_device(self._key))
        where = xp.reshape(self._lengths, (*self._lengths.shape, 1, 1, 1))
        for t in range(n):
            here = xp.reshape(slots, (self.capacity, 1)) == where + t
            self._key = xp.where(here, key[..., t:t + 1, :], self._key)
            self._value = xp.where(here, value[..., t:t + 1, :], self._value)
        self._lengths = self._lengths + n
        self._length += n
        return self.keys, self.values

    def reset(self) -> None:
        """Forget every position (the buffers are reused)."""
        self._length = 0
        if self._lengths is not None:
            self._lengths = self._xp.zeros_like(self._lengths)

    def __repr__(self) -> str:
        return (f"KVCache(shape={tuple(self._key.shape)}, value_head_dim="
                f"{self._value.shape[-1]}, length={self._length}, "
                f"dtype={dtype_name(self._key.dtype)})")

