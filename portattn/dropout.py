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
namespace as the ``seeds`` of its entry in the group ``portattn.libraries``.

Kernel authors: :func:`seed_word` once per call, then :func:`kept` (or :func:`tile`)
per tile, in the forward and again in the backward.
"""

from __future__ import annotations

from typing import Any

from ._inputs import describe, to_kernel_layout
from ._kernels import (
    KEEP_BITS,
    KEY,
    M1,
    M2,
    QUERY,
    ROW,
    kept,
    mix,
    rows,
    seed_word,
    seed_words,
    threshold,
    tile,
)
from ._lib import MAX_WORDS, SEED_BITS, check_seed

__all__ = ["KEEP_BITS", "KEY", "M1", "M2", "MAX_WORDS", "QUERY", "ROW", "SEED_BITS",
           "check_seed", "kept", "mask", "mix", "rows", "seed_word", "seed_words", "threshold",
           "tile"]




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
    query, key, _ = to_kernel_layout(layout, query, key, key)
    inputs = describe(query, key, key, dropout_p=dropout_p,
                      dropout_seed=dropout_seed, layout=layout)
    if not inputs.dropout_p:  # every pair kept, and no seed to read
        xp = inputs.xp
        shape = (*inputs.batch_shape, inputs.num_heads, inputs.q_len, inputs.kv_len)
        return xp.ones(shape, dtype=xp.bool, device=inputs.device_obj)
    return tile(inputs, seed_word(inputs), 0, inputs.q_len, 0, inputs.kv_len)
