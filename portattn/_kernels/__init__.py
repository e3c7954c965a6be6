"""The portable kernels, written against the Array API alone: ``reference`` (the
oracle: every score materialised) and ``tiled`` (flash attention: a tile at a time,
skipping what the mask's block form hides), the FlashAttention-2 backward they share
with every library's autograd, the split-KV ``merge``, attention of packed sequences
to paged keys, dropout's counter-based mask, and the rule for outputs of kernels exact
only on finite inputs.

It may import :mod:`portattn.kernel`, :mod:`portattn._inputs`, :mod:`portattn.masks`,
:mod:`portattn._lib` and :mod:`portattn.errors`; never dispatch or the public call.
"""

from __future__ import annotations

from ._cascade import attend_pages_cascading, cascade_summary
from ._dropout import (
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
from ._finite import distrust
from ._flash_backward import Gradients, flash_backward
from ._max_scores import max_scores
from ._merge import merge
from ._paged import attend_pages
from ._portable import with_rows
from ._reference import ReferenceKernel, reference_attention
from ._tiled import TiledKernel, tiled_attention

__all__ = ["KEEP_BITS", "KEY", "M1", "M2", "QUERY", "ROW", "Gradients",
           "ReferenceKernel", "TiledKernel", "attend_pages", "attend_pages_cascading",
           "cascade_summary",
           "distrust", "flash_backward", "kept", "max_scores", "merge", "mix",
           "reference_attention", "rows", "seed_word", "seed_words", "threshold", "tile",
           "tiled_attention", "with_rows"]
