"""Dropout's seed as a call holds it: an int, an integer array of up to 128 bits, or
what the library's plugin takes (a typed JAX key; torch draws one for calls given
none). Checked once, when a call is described; the words a kernel hashes come from it
(:mod:`portattn.dropout`)."""

from __future__ import annotations

import math
from typing import Any

from ._arrays import dtype_name
from ._plugins import seeds_for

__all__ = ["MAX_WORDS", "SEED_BITS", "check_seed"]


MAX_WORDS = 4


SEED_BITS = 32 * MAX_WORDS


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
               f"integer is two); got shape {tuple(seed.shape)}, dtype={dtype_name(seed.dtype)}")
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
