"""Dropout seeds for JAX (the ``seeds`` of the entry point ``portattn.libraries:jax``): a
typed PRNG key (``jax.random.key``) is taken as its key data; legacy keys
(``jax.random.PRNGKey``) are integer arrays the core takes as they are. JAX has no
global generator, so a call with dropout needs a key."""

from __future__ import annotations

from typing import Any

__all__ = ["words"]


def words(seed: Any) -> Any:
    """The key data of a typed PRNG key; anything else as it is (the core refuses
    what is not an integer array)."""
    import jax

    if jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(seed)
    return seed
