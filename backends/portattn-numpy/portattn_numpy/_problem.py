"""One call as the workers see it: NumPy arrays, shapes, tile sizes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from portattn.masks import BlockMask, Mask

    from ._compiled_blocks import CompiledBlocks
    from ._config import Config
    from ._strategy import Strategy

__all__ = ["Problem", "Unit"]

Unit = tuple[tuple[int, ...], int, int, int, int, int]
"""``(batch index, head, q0, q1, lo, hi)``: query rows ``q0:q1`` against keys ``lo:hi``."""


@dataclass(frozen=True)
class Problem:
    """Everything the workers share for one call."""

    query: Any
    key: Any
    value: Any
    out: Any
    """``(*batch, Hq, Lq, Dv)``, zeros: rows no unit touches keep output 0."""
    lse: Any
    """``(*batch, Hq, Lq)`` filled with ``-inf``, or None when not asked for."""
    factor: float
    """Multiplies the queries: the scale, divided by the softcap when there is one,
    times ``log2(e)`` in base 2 without a softcap."""
    softcap: float | None
    """Multiplies ``tanh`` of the scores (times ``log2(e)`` in base 2)."""
    base2: bool
    """Whether scores are in base 2 (``log2(e)`` folded in) and go through an ``exp2``."""
    exponential: Callable[[Any], None]
    """``exponential(a)`` exponentiates ``a`` in place, in the scores' base (``_exponential``)."""
    exponential_rows: Callable[..., None] | None
    """The same over a score tile's rows with their sums in one pass, where it is
    compiled (``_exponential.in_rows``); None otherwise."""
    compiled: CompiledBlocks | None
    """The fast way's blocks without a mask, and its last step, compiled to run with
    no GIL (``_compiled_blocks``), where they can; None otherwise."""
    query_ready: bool
    """Whether BLAS can read the query's rows in place (else they are copied)."""
    bias: Any
    mask: Mask | None
    """The call's mask, bound to it: its ``tile`` masks the partial tiles."""
    blocks: BlockMask | None
    """The mask's block form on the fine grid (``Config.mask_step`` rows by
    ``Config.mask_chunk`` keys), what units and their blocks are planned from; None
    without a mask."""
    shared: tuple | None
    """What plans are stored under for later calls (the mask's structure, the shapes and
    the settings); None where the mask holds arrays: its plans last one call."""
    q_len: int
    kv_len: int
    group: int
    block_q: int
    block_k: int
    tile_elements: int
    """Entries of one score tile (``Config.score_tile_bytes`` over the item size)."""
    config: Config
    """The settings this call was planned with (``_config``)."""
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    """This call's plans of units, where they are not ``shared``, and what it keeps of
    its mask (``_blocks``, ``_mask_tiles``)."""
    planning: Any = field(default_factory=threading.Lock, compare=False, repr=False)
    """Held while a thread claims a plan to make (``_blocks``)."""
    strategy: Strategy | None = None
    """How the call is cut into units and each unit computed (``_strategy``)."""

