"""Dropout every kernel draws alike: a counter-based mask from one seed.

Whether the pair (row, query ``i``, key ``j``) is kept is a hash of the seed and the
three indices (the row is the flat batch index times ``Hq`` plus the query head), so
any tile of the mask is computed on its own: a forward regenerates it tile by tile and
its backward again, nothing of size ``Lq x Lk`` is stored, and every kernel that takes
``dropout_seed`` drops the same pairs for the same seed, whatever its tiles
(:func:`mask` shows them). The hash is MurmurHash3's 32-bit finaliser in int32
arithmetic (wrapping products, logical shifts by masking), which every Array API
library, JAX without x64 and Triton compute alike; a pair is dropped when the low 31
bits of its hash fall below ``dropout_p * 2**31``.

A seed is an integer, and one value gives one mask whatever holds it: a Python int,
a NumPy integer scalar, or a 0-d integer array of the call's library, of any width and
signedness. Its value counts modulo ``2**128`` (negative values in two's complement,
as torch and JAX read negative seeds modulo ``2**64``); an int outside
``[-2**127, 2**128)`` is refused. An integer array of up to 128 bits (up to four 32-bit
words; a 64-bit entry is two words) holds the value of its words, the first the
lowest (a legacy JAX PRNG key, torch's drawn words): ``[5, 7]`` as uint32 is
``5 + 7 * 2**32``, and the top entry of a signed dtype carries the sign.

A library's plugin may take its own kind of seed (a typed JAX key) or hold seeds its
library cannot split into words (torch's unsigned tensors, which have no shifts) and,
where the library has a global generator users seed (torch), draw one for calls given
none; it registers an object with ``words(seed)`` and/or ``draw(like)`` under its
namespace in the entry-point group ``portattn.seeds``.

Kernel authors: :func:`seed_word` once per call, then :func:`kept` (or :func:`tile`)
per tile, in the forward and again in the backward.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._wiring import seeds_for

if TYPE_CHECKING:
    from ._inputs import AttentionInputs

__all__ = ["KEEP_BITS", "KEY", "M1", "M2", "MAX_WORDS", "QUERY", "ROW", "SEED_BITS",
           "check_seed", "kept", "mask", "mix", "rows", "seed_word", "seed_words", "threshold",
           "tile"]

KEEP_BITS = 31
"""A pair is kept when the hash's low 31 bits reach :func:`threshold`."""

# The finaliser's constants and the odd multipliers that spread the row, query and
# key indices, as signed int32 (Python ints must fit the arrays' dtype).
M1, M2 = -2048144789, -1028477387  # 0x85EBCA6B, 0xC2B2AE35
ROW, QUERY, KEY = -1640531527, 0x27D4EB2F, 0x165667B1
MAX_WORDS = 4
SEED_BITS = 32 * MAX_WORDS


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
    """Pairs whose hash (its low :data:`portattn.dropout.KEEP_BITS` bits) is below this
    are dropped."""
    return min(round(dropout_p * (1 << KEEP_BITS)), (1 << KEEP_BITS) - 1)


def check_seed(xp: Any, seed: Any, namespace: str) -> Any:
    """``seed`` as a call may hold it: an int in ``[-2**127, 2**128)``, an integer array
    of 1 to 4 words of 32 bits (any shape), what the library's plugin takes, or None
    when the library has a generator to draw from. Raises ``TypeError``/``ValueError``
    naming ``dropout_seed``."""
    if seed is None:
        plugin = seeds_for(namespace)
        if plugin is None or not hasattr(plugin, "draw"):
            msg = (f"dropout_p > 0 on {namespace} arrays needs dropout_seed (an int or an "
                   f"integer array, e.g. a JAX PRNG key): {namespace} has no global "
                   "generator portattn draws from")
            raise ValueError(msg)
        return None
    if isinstance(seed, bool) or (not isinstance(seed, int) and not hasattr(seed, "dtype")):
        msg = f"dropout_seed must be an int or an integer array; got {seed!r}"
        raise TypeError(msg)
    if isinstance(seed, int):
        if not -(1 << (SEED_BITS - 1)) <= seed < 1 << SEED_BITS:
            msg = (f"dropout_seed must be an int in [-2**127, 2**128) (it counts modulo "
                   f"2**128); got dropout_seed={seed}")
            raise ValueError(msg)
        return seed
    plugin = seeds_for(namespace)
    words = getattr(plugin, "words", None)
    if not _integral(xp, seed.dtype) and words is not None:
        seed = words(seed)  # a library's own kind of seed (a typed JAX key)
    if not _integral(xp, seed.dtype):
        msg = f"dropout_seed must have an integer dtype; got dtype={seed.dtype}"
        raise TypeError(msg)
    count = math.prod(seed.shape) * (2 if xp.iinfo(seed.dtype).bits > 32 else 1)
    if count not in range(1, MAX_WORDS + 1):
        msg = (f"dropout_seed must hold 1 to {MAX_WORDS} integers of 32 bits (a 64-bit "
               f"integer is two); got shape {tuple(seed.shape)}, dtype={_dtype_text(seed)}")
        raise ValueError(msg)
    # words the library's operations cannot split (torch's unsigned tensors)
    return seed if words is None else words(seed)


def _integral(xp: Any, dtype: Any) -> bool:
    try:
        return bool(xp.isdtype(dtype, "integral"))
    except Exception:  # a library's own kind (a typed PRNG key's dtype)
        return False


def _dtype_text(a: Any) -> str:
    name = getattr(a.dtype, "name", None)
    return name if isinstance(name, str) else str(a.dtype).rsplit(".", 1)[-1]


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


def mask(query: Any, key: Any, *, dropout_p: float, dropout_seed: Any,
         layout: str = "bhld") -> Any:
    """The pairs a call of :func:`portattn.attention` with these arguments keeps:
    every kernel that takes ``dropout_seed`` drops the same ones.

    Args:
        query: as for :func:`portattn.attention` (its values are not read).
        key: as for :func:`portattn.attention`.
        dropout_p: the probability of dropping a pair (0: every pair is kept).
        dropout_seed: an int or an integer array (see :func:`portattn.attention`).
        layout: as for :func:`portattn.attention`.

    Returns:
        Booleans ``(..., Hq, Lq, Lk)``, True where the pair is kept; materialises
        ``Lq x Lk``.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import dropout
        >>> rng = np.random.default_rng(0)
        >>> q, k, v = (rng.standard_normal((1, 2, 16, 8)) for _ in range(3))
        >>> out, weights = portattn.attention(q, k, v, dropout_p=0.25, dropout_seed=3,
        ...                                   return_weights=True)
        >>> kept = dropout.mask(q, k, dropout_p=0.25, dropout_seed=3)
        >>> bool(np.all((weights == 0) == ~kept))  # the weights as applied
        True
    """
    from ._inputs import describe
    from ._layout import to_kernel_layout

    query, key, _ = to_kernel_layout(layout, query, key, key)
    inputs = describe(query, key, key, dropout_p=dropout_p,
                      dropout_seed=dropout_seed, layout=layout)
    if not inputs.dropout_p:  # every pair kept, and no seed to read
        xp = inputs.xp
        shape = (*inputs.batch_shape, inputs.num_heads, inputs.q_len, inputs.kv_len)
        return xp.ones(shape, dtype=xp.bool, device=inputs.device_obj)
    return tile(inputs, seed_word(inputs), 0, inputs.q_len, 0, inputs.kv_len)
