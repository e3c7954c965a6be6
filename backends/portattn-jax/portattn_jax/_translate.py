"""portattn's structured masks in the terms of ``jax.nn.dot_product_attention``.

JAX places query ``i`` at position ``i`` (top-left) and describes positional masks as
one band: query ``i`` sees keys ``i - left <= j <= i + right`` (``local_window_size``;
``is_causal`` is the band with ``right = 0``). portattn folds every causal and
sliding-window part of a mask into one such band (``Mask.band``), which is only
re-signed here.
Key and query lengths map to their JAX arguments one to one. Every other part (dense
masks, ranges, documents, the sparse patterns, mask functions, unions) is kept as a
mask part and becomes one boolean array in the call, built with the part's ``tile``
(:meth:`MaskSpec.dense_arrays`): JAX's XLA path materialises the score matrix anyway.

Everything here is static (Python ints) or a plain pass-through of the mask's parts
(several lengths of one kind are combined later, inside the compiled call): folding a
mask allocates nothing, so ``not_supported_reasons`` may call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from portattn import masks

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs
    from portattn.masks import Mask

__all__ = ["Band", "MaskSpec", "fold_mask"]


@dataclass(frozen=True)
class Band:
    """Keys ``i - left <= j <= i + right`` for query ``i`` (top-left); None = unbounded."""

    left: int | None
    right: int | None

    def normalized(self, lq: int, lk: int) -> Band | None:
        """The same band with bounds that exclude nothing dropped; None if it is all keys."""
        left = None if self.left is not None and self.left >= lq - 1 else self.left
        right = None if self.right is not None and self.right >= lk - 1 else self.right
        return None if left is None and right is None else Band(left, right)

    def window(self, lq: int, lk: int) -> tuple[int, int]:
        """``local_window_size`` for JAX: unbounded sides become a bound that excludes
        nothing."""
        wide = lq + lk
        return (wide if self.left is None else self.left,
                wide if self.right is None else self.right)

    def rows_with_keys(self, lq: int, lk: int) -> tuple[int, int]:
        """Half-open range of the queries that have at least one key in the band.

        Row ``i`` keeps ``max(0, i - left) <= min(lk - 1, i + right)``, which is
        ``-right <= i <= lk - 1 + left`` when ``left + right >= 0`` and no row otherwise.
        """
        left = lq if self.left is None else self.left
        right = lk if self.right is None else self.right
        if left + right < 0 or lk == 0:
            return 0, 0
        start, stop = max(0, -right), min(lq, lk + left)
        return (start, stop) if start < stop else (0, 0)


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """A portattn mask as JAX's arguments (arrays still in portattn's batch layout)."""

    band: Band | None = None
    key_lengths: tuple[Any, ...] = ()
    """``(*batch)`` integer arrays; a key must lie below each."""
    query_lengths: tuple[Any, ...] = ()
    computed: tuple[Mask, ...] = ()
    """Parts whose boolean arrays are built only when the call runs."""

    @property
    def has_dense(self) -> bool:
        """Whether the call takes a boolean mask array."""
        return bool(self.computed)

    def dense_arrays(self, rank: int, lq: int, lk: int) -> tuple[Any, ...]:
        """The boolean arrays of :attr:`computed` at full rank ``(*batch|1, H|1, Lq|1,
        Lk|1)`` (allocates); a pair must be in all."""
        import jax
        import jax.numpy as jnp

        arrays = []
        for part in self.computed:
            with jax.numpy_rank_promotion("allow"):  # tiles broadcast by the array API
                tile = jnp.asarray(part.tile(jnp, 0, lq, 0, lk, lq, lk), dtype=bool)
            arrays.append(jnp.reshape(tile, (1,) * (rank - tile.ndim) + tile.shape))
        return tuple(arrays)

    def all_rows_have_keys(self, lq: int, lk: int) -> bool:
        """True when no query row can be left without keys, known without reading data."""
        if self.key_lengths or self.query_lengths or self.has_dense:
            return False
        if self.band is None:
            return lk > 0
        return self.band.rows_with_keys(lq, lk) == (0, lq)


def fold_mask(inputs: AttentionInputs) -> MaskSpec:
    """Fold every part of ``inputs.mask`` into one :class:`MaskSpec`."""
    mask: Mask | None = inputs.mask
    if mask is None:
        return MaskSpec()
    lq, lk = inputs.q_len, inputs.kv_len
    split = masks.band_and_lengths(mask, lq, lk)
    band = split.band
    if band is not None:
        # portattn's band is lower <= j - i <= upper; JAX's is i - left <= j <= i + right.
        band = Band(None if band.lower is None else -band.lower, band.upper).normalized(lq, lk)
    return MaskSpec(band, split.key_lengths, split.query_lengths, split.rest)
