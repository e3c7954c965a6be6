"""The ``numpy_fast`` kernel: declarations, and the call that runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from portattn.kernel import Kernel, values_readable
from portattn.masks import KINDS, is_positional

from ._config import current

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs, PagedInputs

__all__ = ["LENDING", "NumpyFastKernel"]

#: The libraries whose CPU arrays paged calls borrow through DLPack, without a copy.
LENDING = frozenset({"torch", "jax"})


class NumpyFastKernel(Kernel):
    """Tiled, threaded attention for NumPy float32/float64 arrays on the CPU.

    Paged calls (masks of causal and window parts) run a compiled loop that reads each
    sequence's keys from its pages a chunk at a time, where Numba is installed
    (``_compiled_paged``). Besides NumPy's arrays it takes any library's CPU arrays
    that DLPack lends without a copy (torch's tensors, JAX's arrays outside a trace),
    and gives the result back the same way: paged attention is forward only, so no
    autograd is lost.

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
        # the declared namespaces are those of attention calls: paged calls take the
        # libraries of LENDING too, judged below
        reasons = [why for why in super().paged_reasons(call)
                   if not why.startswith("namespace=")]
        if call.namespace != "numpy":
            reasons += _lending_reasons(call)
        traced = call.host_plan_reason()
        if traced is not None:
            reasons.append(traced)
        if call.mask is not None and not is_positional(call.mask):
            reasons.append(f"mask {call.mask!r} is not made of causal and window parts")
        if not reasons and _compiled_paged() is None:
            reasons.append("numba is not installed (portattn-numpy[jit])")
        return reasons

    def run_paged(self, call: PagedInputs) -> tuple[Any, Any]:
        import numpy as np

        from ._decode import paged_threads

        band = None if call.mask is None else call.mask.band(0, 0)
        lower, upper = (None, None) if band is None else (band.lower, band.upper)

        def borrowed(a: Any) -> Any:  # NumPy's view of the caller's memory, no copy
            return a if a is None or call.namespace == "numpy" else np.from_dlpack(a)

        out, lse = _compiled_paged().paged_forward(
            borrowed(call.query), borrowed(call.key_pages), borrowed(call.value_pages),
            call.head_major, np.asarray(call.host_table, dtype=np.int32),
            np.asarray(call.query_starts, dtype=np.int64),
            np.asarray(call.key_lengths, dtype=np.int64), lower, upper, call.scale,
            call.softcap, borrowed(call.alibi_slopes), borrowed(call.sinks),
            paged_threads(call.query.shape[1], call.query_starts, call.key_lengths,
                          call.query.shape[2] + call.value_pages.shape[-1]))
        if call.namespace == "numpy":
            return out, lse
        return call.xp.from_dlpack(out), call.xp.from_dlpack(lse)


def _lending_reasons(call: PagedInputs) -> list[str]:
    """Why ``call``'s arrays, of another library than NumPy, cannot be lent to NumPy."""
    reasons = []
    if call.namespace not in LENDING:
        reasons.append(f"namespace={call.namespace} (paged calls: "
                       f"{', '.join(['numpy', *sorted(LENDING)])})")
    arrays = (call.query, call.key_pages, call.value_pages)
    if not all(values_readable(a) for a in arrays):
        reasons.append("traced or lazy arrays cannot be lent to NumPy")
    if any(getattr(a, "requires_grad", False) is True for a in arrays):
        reasons.append("arrays that require gradients (paged calls run forward only here)")
    return reasons


def _compiled_paged() -> Any:
    from ._jit import load

    return load("_compiled_paged")
