"""Decode steps by the compiled paged loop: a contiguous cache is a pool of pages.

A decode step (a few queries against a long cache) has little arithmetic per key and
reads every key and value once, so its time is the pass over the cache plus what
each call adds. The tiles and stacked heads of ``_run`` make that pass in NumPy calls
per head (two products, the exponential, the sums): several passes, from one thread
where the call is too small to share. The paged loop (``_compiled_paged``) makes it
in one compiled pass per key/value head, on every thread, and reads each
sequence's rows in place where they lie evenly spaced in one page. A cache
``(*batch, Hkv, Lk, D)`` is such a pool: one head-major page of ``Lk`` rows per batch
element. Queries are its last positions (``Lk - Lq + i``), as in the kernels'
bottom-right alignment, so a mask of causal and window parts is the loop's band,
shifted by ``Lk - Lq``.

The loop keeps the package's rule for non-finite values itself (a row that sees a
non-finite key or value is NaN) and gives the sizes of each sequence alone, so its
bits do not depend on the batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from portattn.masks import is_positional

from . import _cblas
from ._jit import load
from ._threads import get_num_threads
from ._units import work

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

    from ._config import Config

__all__ = ["DECODE_QUERIES", "decode_step", "paged_threads"]

#: The most queries a call may have to be run as a decode step; longer calls are the
#: plan's, whose tiles share each read of a key among their rows. (On 2 cores the loop
#: took 0.22-0.71x the plan's time with 2 to 16 queries, 0.56-0.69x with one query per
#: head where the work fills two threads.)
DECODE_QUERIES = 16
#: Work (``_units.work``) a thread must get before waking it pays, in the paged loop.
#: A decode step's work is mostly its pass over the keys and values; on 2 cores, one
#: query of 8 heads of 64 took 148 us on one thread and 226 on two against 1024 keys,
#: 237 and 217 against 2048 (about this much work), 479 and 330 against 4096.
MIN_WORK_PER_THREAD = 1 << 17


def paged_threads(heads: int, query_starts: Any, key_lengths: Any, width: int) -> int:
    """How many of the package's threads the paged loop's call keeps busy: ``heads``
    query heads, sequences of ``key_lengths`` keys with the queries ``query_starts``
    delimit, and ``width`` the head dims ``D + Dv``."""
    counts = np.diff(np.asarray(query_starts, dtype=np.int64))
    total = int(work(heads, counts, np.asarray(key_lengths, dtype=np.int64), width).sum())
    return max(1, min(get_num_threads(), total // MIN_WORK_PER_THREAD))


def decode_step(inputs: AttentionInputs, config: Config) -> tuple[Any, Any] | None:
    """``(out, lse)`` of a decode step by the compiled paged loop; None for a call it
    does not take (then the plan runs it)."""
    if not _takes(inputs, config):
        return None
    paged = load("_compiled_paged")
    if paged is None or _cblas.gemm_address(inputs.query.dtype) is None:
        return None
    lq, lk, heads = inputs.q_len, inputs.kv_len, inputs.num_heads
    sequences = math.prod(inputs.batch_shape)
    starts = np.arange(0, (sequences + 1) * lq, lq, dtype=np.int64)
    lengths = np.full(sequences, lk, dtype=np.int64)
    threads = paged_threads(heads, starts, lengths, inputs.head_dim + inputs.value_head_dim)
    if lq == 1 and threads == 1:
        # one thread's worth of one row per head: the plan's stacked heads are as fast
        # (this loop took 1.04-1.09x their time at 8 heads of 64 over 256 and 2048 keys)
        return None
    band = _band(inputs)
    key_pages, value_pages = _pages(inputs.key), _pages(inputs.value)
    if band is None or key_pages is None or value_pages is None:
        return None
    lower, upper = band
    table = np.arange(sequences, dtype=np.int32)[:, None]  # sequence s: page s
    # (*batch, Hq, Lq, D) -> (S * Lq, Hq, D): each sequence's queries end to end
    query = inputs.query.reshape(sequences, heads, lq, -1).swapaxes(1, 2).reshape(
        sequences * lq, heads, -1)
    out, lse = paged.paged_forward(query, key_pages, value_pages, True, table, starts,
                                   lengths, lower, upper, inputs.scale, inputs.softcap,
                                   None, None, threads)
    out = out.reshape(sequences, lq, heads, -1).swapaxes(1, 2)
    out = np.ascontiguousarray(out).reshape(*inputs.batch_shape, heads, lq, -1)
    if not inputs.return_lse:
        return out, None
    lse = lse.reshape(heads, sequences, lq).swapaxes(0, 1)
    return out, np.ascontiguousarray(lse).reshape(*inputs.batch_shape, heads, lq)


def _takes(inputs: AttentionInputs, config: Config) -> bool:
    """Is the call a decode step the loop computes as asked: few queries, no more than
    keys, a mask of causal and window parts or none, and nothing the loop does not
    take (a bias, a score change, dropout). Hooks on tiles and units ask for the
    plan, whose tiles they observe."""
    if not config.compiled_decode or config.on_tile is not None or config.on_unit is not None:
        return False
    if not 1 <= inputs.q_len <= min(DECODE_QUERIES, inputs.kv_len):
        return False
    if 0 in (inputs.num_heads, inputs.head_dim, inputs.value_head_dim, *inputs.batch_shape):
        return False
    if inputs.bias is not None or inputs.score_mod is not None or inputs.dropout_p:
        return False
    if inputs.alibi_slopes is not None or inputs.sinks is not None:
        return False
    return inputs.mask is None or is_positional(inputs.mask)


def _pages(array: Any) -> Any:
    """``array`` (``(*batch, Hkv, Lk, D)``) as a head-major pool with one page per
    batch element; None where its batch dims cannot be one axis without a copy."""
    pool = array.reshape(-1, *array.shape[-3:])
    return pool if np.may_share_memory(pool, array) else None  # else reshaped by a copy


def _band(inputs: AttentionInputs) -> tuple[int | None, int | None] | None:
    """The mask's band in the loop's terms: key ``j`` is seen from position ``p`` where
    ``lower <= j - p <= upper`` (None: open), with query ``i`` at ``p = Lk - Lq + i``;
    None where the mask has no band."""
    if inputs.mask is None:
        return None, None
    band = inputs.mask.band(inputs.q_len, inputs.kv_len)
    if band is None:
        return None
    shift = inputs.kv_len - inputs.q_len  # j - i = (j - p) + shift
    return (None if band.lower is None else band.lower - shift,
            None if band.upper is None else band.upper - shift)
