"""The ``numpy_fast`` kernel: declarations, and the call that runs it."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any, ClassVar

from portattn.kernel import Kernel
from portattn.masks import KINDS, is_positional

from ._config import current

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs, PagedInputs

#: The most queries of one sequence the compiled paged loop takes (decode steps and
#: short speculative ones); longer prompts are products for BLAS, in the portable loop.
PAGED_QUERIES = 16

__all__ = ["NumpyFastKernel"]


class NumpyFastKernel(Kernel):
    """Tiled, threaded attention for NumPy float32/float64 arrays on the CPU.

    Paged calls of decode steps (at most :data:`PAGED_QUERIES` queries per sequence,
    masks of causal and window parts) run a compiled loop that reads each sequence's
    keys in place from its pages, where Numba is installed.

    Score changes (``score_mod``, :mod:`portattn.scores`) join the scores where a bias
    does: by distance (T5's buckets, ALiBi's slopes) from a vector per head whose views
    are each tile's entries; any other from entries made once for all the batch
    elements and heads that read them (``_changes``).

    BLAS does the two products of each tile; the softmax runs in place on a score
    tile of twice the L2 cache (or the size ``python -m portattn tune`` timed fastest);
    a thread pool works through (batch, head, query tile) units. Thread count:
    :func:`portattn_numpy.set_num_threads`, else the ``PORTATTN_NUMPY_THREADS``
    environment variable, else the CPUs available.
    """

    name = "numpy_fast"
    namespaces = frozenset({"numpy"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float32", "float64"})
    masks = frozenset(KINDS)  # every kind: masks are read through their block form
    bias = softcap = score_mod = gqa = value_head_dim = empty = True
    returns_lse = True
    paged = True
    priority = 50
    # Bytes of one score tile (see Config.tile_bytes): the best size differs by machine.
    tunables: ClassVar[dict[str, tuple[Any, ...]]] = {
        "tile_bytes": (512 << 10, 1 << 20, 2 << 20, 4 << 20)}

    @classmethod
    def check_available(cls) -> str | None:
        try:
            import numpy  # noqa: F401
            import threadpoolctl  # noqa: F401
        except ImportError as e:
            return f"{e.name} is not installed"
        return None

    def run(self, inputs: AttentionInputs) -> tuple[Any, Any, Any]:
        # NumPy loads with the first call, not when portattn discovers the kernel
        from ._call import attend

        config = current()  # read once, here: the worker threads see the same settings
        # the tuned size is read on the calling thread, where a tune run sets its trial
        tuned = None if config.tile_bytes is not None else self.tuned("tile_bytes")
        return (*attend(inputs, config, config.score_tile_bytes(tuned)), None)

    @classmethod
    def paged_reasons(cls, call: PagedInputs) -> list[str]:
        reasons = super().paged_reasons(call)
        if call.mask is not None and not is_positional(call.mask):
            reasons.append(f"mask {call.mask!r} is not made of causal and window parts")
        starts = call.query_starts
        most = max((b - a for a, b in pairwise(starts)), default=0)
        if most > PAGED_QUERIES:
            reasons.append(f"{most} queries in one sequence > {PAGED_QUERIES}")
        if not reasons and _compiled_paged() is None:
            reasons.append("numba is not installed (portattn-numpy[jit])")
        return reasons

    def run_paged(self, call: PagedInputs) -> tuple[Any, Any]:
        import numpy as np

        band = None if call.mask is None else call.mask.band(0, 0)
        lower, upper = (None, None) if band is None else (band.lower, band.upper)

        def host(a: Any) -> Any:
            return None if a is None else np.ascontiguousarray(a)

        return _compiled_paged().paged_decode(
            call.query, call.key_pages, call.value_pages, call.head_major,
            np.asarray(call.host_table, dtype=np.int32),
            np.asarray(call.query_starts, dtype=np.int64),
            np.asarray(call.key_lengths, dtype=np.int64), lower, upper, call.scale,
            call.softcap, host(call.alibi_slopes), host(call.sinks))


def _compiled_paged() -> Any:
    from ._jit import load

    return load("_compiled_paged")
