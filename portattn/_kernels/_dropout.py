"""Dropout's mask as every kernel draws it: a counter-based hash of the seed and the
(row, query, key) indices, computed tile by tile in any Array API library (see
:mod:`portattn.dropout`, which documents it and exports it to kernel authors)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._lib import MAX_WORDS, SEED_BITS, seeds_for

if TYPE_CHECKING:
    from .._inputs import AttentionInputs

__all__ = ["KEEP_BITS", "KEY", "M1", "M2", "QUERY", "ROW", "kept", "mix", "rows", "seed_word",
           "seed_words", "threshold", "tile"]

# The finaliser's constants and the odd multipliers that spread the row, query and
# key indices, as signed int32 (Python ints must fit the arrays' dtype).
M1, M2 = -2048144789, -1028477387  # 0x85EBCA6B, 0xC2B2AE35
ROW, QUERY, KEY = -1640531527, 0x27D4EB2F, 0x165667B1


KEEP_BITS = 31
"""A pair is kept when the hash's low 31 bits reach :func:`threshold`."""


def _signed(word: int) -> int:
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


def mix(h: Any) -> Any:
    """MurmurHash3's finaliser on an int32 array (products wrap; ``>>`` is made
    logical by masking the sign's copies)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * M1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * M2
    return h ^ ((h >> 16) & 0xFFFF)


def threshold(dropout_p: float) -> int:
    """Pairs whose hash (its low ``KEEP_BITS`` bits) is below this are dropped."""
    return min(round(dropout_p * (1 << KEEP_BITS)), (1 << KEEP_BITS) - 1)


def seed_words(inputs: AttentionInputs) -> Any:
    """The call's seed as its value's four int32 words modulo ``2**128``, the lowest
    first, on the call's device; drawn from the library's generator when the call has
    no seed. A kernel whose backward runs apart from its forward puts these in the
    call's ``dropout_seed`` before the forward (words give themselves back), so both
    draw the same mask.

    Args:
        inputs: the call's :class:`~portattn.kernel.AttentionInputs`.

    Returns:
        ``(4,)`` int32.

    Example:
        >>> import numpy as np
        >>> from portattn import dropout
        >>> from portattn.kernel import describe
        >>> q = np.zeros((1, 1, 4, 8), np.float32)
        >>> dropout.seed_words(describe(q, q, q, dropout_p=0.5, dropout_seed=2**32 + 5))
        array([5, 1, 0, 0], dtype=int32)
    """
    xp, seed = inputs.xp, inputs.dropout_seed
    if seed is None:
        plugin = seeds_for(inputs.namespace)
        if plugin is None or not hasattr(plugin, "draw"):
            msg = (f"no dropout_seed to take words from, and {inputs.namespace} has no "
                   "generator to draw one from")
            raise ValueError(msg)
        seed = plugin.draw(inputs.query)
    if isinstance(seed, int):
        value = seed % (1 << SEED_BITS)
        return xp.asarray([_signed(value >> (32 * n)) for n in range(MAX_WORDS)],
                          dtype=xp.int32, device=inputs.device_obj)
    return _value_words(xp, xp.reshape(seed, (-1,)))


def seed_word(inputs: AttentionInputs) -> Any:
    """:func:`seed_words` folded into the one int32 word :func:`kept` hashes with, an
    array of shape ``(1,)`` (never 0-d: NumPy makes scalars of those, which warn where
    products wrap). The zero words above the value's highest nonzero one are left out
    of the fold: a value gives one word however many words hold it.

    Example:
        >>> import numpy as np
        >>> from portattn import dropout
        >>> from portattn.kernel import describe
        >>> q = np.zeros((1, 1, 4, 8), np.float32)
        >>> dropout.seed_word(describe(q, q, q, dropout_p=0.5, dropout_seed=7)).shape
        (1,)
    """
    xp = inputs.xp
    words = seed_words(inputs)
    word = mix(words[:1] + ROW)
    for n in range(1, MAX_WORDS):
        # where, not a branch: the words may be traced or on a device
        word = xp.where(xp.any(words[n:] != 0), mix(word ^ words[n:n + 1]), word)
    return word


def _value_words(xp: Any, seed: Any) -> Any:
    """A 1-d integer array of up to 128 bits as its value's four int32 words modulo
    ``2**128``: the entries' words, the first the lowest, then the top entry's sign."""
    words = _int32_words(xp, seed)
    missing = MAX_WORDS - words.shape[0]
    if not missing:
        return words
    top = words[-1:]
    fill = xp.zeros_like(top)
    if xp.iinfo(seed.dtype).min < 0:  # a negative value: all ones above it
        fill = xp.where(top < 0, fill - 1, fill)
    return xp.concat([words, *(fill,) * missing])


def _int32_words(xp: Any, seed: Any) -> Any:
    """A 1-d integer array as int32 words, each entry's lowest first: 64-bit entries
    give their low and high halves, 32-bit unsigned ones wrap (a cast of such values
    is undefined in the standard, and JAX without x64 has no wider type to go
    through)."""
    info = xp.iinfo(seed.dtype)
    if info.bits < 32 or seed.dtype == xp.int32:
        return xp.astype(seed, xp.int32)
    if info.bits == 32:
        return _from_unsigned(xp, seed)
    high = seed >> 32  # int64: within int32; uint64: below 2**32
    high = xp.astype(high, xp.int32) if info.min < 0 else _from_unsigned(xp, high)
    low = _from_unsigned(xp, seed & 0xFFFFFFFF)
    return xp.reshape(xp.stack([low, high], axis=1), (-1,))


def _from_unsigned(xp: Any, x: Any) -> Any:
    """Integers in ``[0, 2**32)`` as int32, the upper half wrapping to negatives."""
    low = xp.astype(x & 0x7FFFFFFF, xp.int32)
    return xp.where(((x >> 31) & 1) == 1, low + (-(1 << 31)), low)


def kept(word: Any, rows: Any, queries: Any, keys: Any, dropout_p: float) -> Any:
    """Which pairs dropout keeps, as booleans broadcast from the indices' shapes.

    Args:
        word: :func:`seed_word`.
        rows: int32 row indices, the flat batch index times ``Hq`` plus the query
            head (see :func:`rows`), shaped ``(..., 1, 1)``.
        queries: int32 query positions in the call, ``(..., tq, 1)``.
        keys: int32 key positions in the call, ``(..., 1, tk)``.
        dropout_p: the probability of dropping a pair.

    Returns:
        True where the pair is kept.

    Example:
        >>> import numpy as np
        >>> from portattn import dropout
        >>> word = np.asarray([7], np.int32)
        >>> i = np.arange(64, dtype=np.int32)[:, None]
        >>> j = np.arange(64, dtype=np.int32)[None, :]
        >>> rows = np.zeros((1, 1), np.int32)
        >>> kept = dropout.kept(word, rows, i, j, 0.25)
        >>> kept.shape, bool(abs(kept.mean() - 0.75) < 0.02)
        ((64, 64), True)
    """
    row = mix(mix(rows * ROW + word[0]))
    return (mix(mix(row ^ (queries * QUERY)) ^ (keys * KEY)) & 0x7FFFFFFF) >= threshold(
        dropout_p)


def tile(inputs: AttentionInputs, word: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
    """:func:`kept` over one tile of a call, ``(*batch, Hq, q1 - q0, k1 - k0)``.

    Example:
        >>> import numpy as np
        >>> from portattn import dropout
        >>> from portattn.kernel import describe
        >>> q = np.zeros((2, 3, 16, 8), np.float32)
        >>> inputs = describe(q, q, q, dropout_p=0.5, dropout_seed=7)
        >>> dropout.tile(inputs, dropout.seed_word(inputs), 0, 4, 8, 16).shape
        (2, 3, 4, 8)
    """
    xp, dev = inputs.xp, inputs.device_obj
    row = rows(xp, inputs.batch_shape, inputs.num_heads, dev)
    lead = (1,) * (row.ndim - 2)
    i = xp.reshape(xp.arange(q0, q1, dtype=xp.int32, device=dev), (*lead, q1 - q0, 1))
    j = xp.reshape(xp.arange(k0, k1, dtype=xp.int32, device=dev), (*lead, 1, k1 - k0))
    return kept(word, row, i, j, inputs.dropout_p)


def rows(xp: Any, batch_shape: tuple[int, ...], num_heads: int, device: Any) -> Any:
    """``(*batch, Hq, 1, 1)`` int32: each (batch element, query head)'s row index.

    Example:
        >>> import numpy as np
        >>> from portattn import dropout
        >>> dropout.rows(np, (2,), 3, None)[:, :, 0, 0].tolist()
        [[0, 1, 2], [3, 4, 5]]
    """
    count = math.prod(batch_shape) * num_heads
    flat = xp.arange(count, dtype=xp.int32, device=device)
    return xp.reshape(flat, (*batch_shape, num_heads, 1, 1))
