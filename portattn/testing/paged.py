"""Paged inputs for tests: sequences' keys and values scattered over a page pool."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["scattered_pages"]


def scattered_pages(rng: np.random.Generator, lengths: list[int], page: int,
                    num_kv_heads: int, head_dim: int, value_head_dim: int, *,
                    layout: str = "blhd", garbage: float = np.nan,
                    spare: int = 2) -> tuple[Any, Any, Any, list[tuple[Any, Any]]]:
    """Keys and values of sequences of ``lengths`` tokens (float32 draws of ``rng``),
    their pages in random order over a pool with ``spare`` pages more, every slot no
    sequence holds set to ``garbage``.

    Returns:
        ``(key_pages, value_pages, block_table, own)``: the pools in ``layout``
        (``"blhd"``: ``(P, page, Hkv, D)``; ``"bhld"``: ``(P, Hkv, page, D)``), the
        int32 table (``-1`` past a sequence's pages; one column more than the longest
        needs) and each sequence's own keys ``(n, Hkv, D)`` and values ``(n, Hkv, Dv)``.
    """
    needed = [-(-n // page) for n in lengths]
    total = sum(needed) + spare
    order = iter(rng.permutation(total))
    k_pool = np.full((total, page, num_kv_heads, head_dim), garbage, dtype=np.float32)
    v_pool = np.full((total, page, num_kv_heads, value_head_dim), garbage, dtype=np.float32)
    table = np.full((len(lengths), max(needed, default=0) + 1), -1, dtype=np.int32)
    own = []
    for s, n in enumerate(lengths):
        k = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, num_kv_heads, value_head_dim)).astype(np.float32)
        for j in range(needed[s]):
            table[s, j] = p = next(order)
            rows = slice(j * page, min(n, (j + 1) * page))
            k_pool[p, :rows.stop - rows.start] = k[rows]
            v_pool[p, :rows.stop - rows.start] = v[rows]
        own.append((k, v))
    if layout == "bhld":
        k_pool = np.ascontiguousarray(k_pool.transpose(0, 2, 1, 3))
        v_pool = np.ascontiguousarray(v_pool.transpose(0, 2, 1, 3))
    return k_pool, v_pool, table, own
