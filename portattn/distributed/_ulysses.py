"""The ``"ulysses"`` strategy: all-to-all from sequence shards to head shards and back.

Each rank trades its shard of every head for every rank's shard of ``1 / size`` of the
heads, attends over the whole sequence for those heads in one call of
:func:`portattn.attention` (any kernel, the mask in global positions as given), and
trades back. Two all-to-alls each way, no merge; the heads (query and key/value) must
divide by the number of ranks, and the mask must not vary by head. Gradients come from
the library's autograd through the all-to-alls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._call import attention

if TYPE_CHECKING:
    from ._layout import Layout
    from ._plan import Problem

__all__ = ["ulysses"]


def ulysses(comm: Any, problem: Problem, query: Any, key: Any,
            value: Any) -> tuple[Any, Any]:
    """``(out, lse)`` of this rank's query shard; ``comm.all_to_all(parts)`` returns
    what every rank sent this one, in rank order."""
    xp, size = problem.xp, problem.size

    def to_heads(x: Any, layout: Layout) -> Any:
        """``(..., H, S, D)`` shards -> ``(..., H / size, L, D)`` in sequence order."""
        h = x.shape[-3] // size
        got = comm.all_to_all([x[..., i * h:(i + 1) * h, :, :] for i in range(size)])
        return layout.from_rank_major(xp.concat(got, axis=-2))

    def to_sequence(y: Any, layout: Layout, fill: float = 0) -> Any:
        """The inverse: ``(..., H / size, L, D)`` -> this rank's ``(..., H, S, D)``."""
        laid, n = layout.rank_major(y, fill=fill), layout.shard_length
        got = comm.all_to_all([laid[..., r * n:(r + 1) * n, :] for r in range(size)])
        return xp.concat(got, axis=-3)

    q = to_heads(query, problem.queries)
    k, v = to_heads(key, problem.keys), to_heads(value, problem.keys)
    out, lse = attention(q, k, v, mask=problem.unbound, return_lse=True, **problem.options)
    return (to_sequence(out, problem.queries),
            to_sequence(lse[..., None], problem.queries, -float("inf"))[..., 0])


def heads_problem(query: Any, key: Any, size: int) -> str | None:
    """Why the heads cannot be split over ``size`` ranks (None: they can)."""
    hq, hkv = query.shape[-3], key.shape[-3]
    if hq % size or hkv % size:
        return (f"strategy='ulysses' splits the heads over the {size} ranks; got "
                f"{hq} query heads and {hkv} key/value heads")
    return None
