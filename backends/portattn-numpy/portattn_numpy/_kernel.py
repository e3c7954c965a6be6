"""The ``numpy_fast`` kernel: declarations, and the call that runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from portattn.kernel import Kernel
from portattn.masks import KINDS

if TYPE_CHECKING:
    from portattn.kernel import AttentionInputs

__all__ = ["NumpyFastKernel"]


class NumpyFastKernel(Kernel):
    """Tiled, threaded attention for NumPy float32/float64 arrays on the CPU.

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
    bias = softcap = gqa = value_head_dim = empty = True
    returns_lse = True
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
        import numpy as np

        from ._config import current
        from ._plan import hides_any_pair

        if not hides_any_pair(inputs, current()):
            # every row weighs every value: NaN or inf among them reaches exactly the
            # rows that see them, and no pass over the values (a decode step's whole
            # cost) is needed to know it; a mask that hides nothing (causal, one
            # decode step) is not applied either
            return (*_attend(inputs._replace(mask=None)), None)
        finite = np.isfinite(inputs.value)
        if finite.all():  # the usual case: one pass over the values to know it
            return (*_attend(inputs), None)
        # A masked key has weight exactly 0, but 0 * NaN is NaN: attend the values with
        # their non-finite entries zeroed, then find the rows that attend a key that held
        # one: zero queries give every key the mask and bias allow the same weight, so
        # a column marking those keys gets weight in exactly those rows (also where the
        # real weight underflowed to 0), which are NaN.
        clean = np.where(finite, inputs.value, 0)
        out, lse = _attend(inputs._replace(value=clean))
        marks = (~finite).any(axis=-1, keepdims=True).astype(inputs.value.dtype)
        bias = inputs.bias
        hits, _ = _attend(inputs._replace(
            query=np.zeros_like(inputs.query), value=marks, value_head_dim=1,
            return_lse=False, softcap=None,
            bias=None if bias is None else np.where(bias == -np.inf, bias, np.zeros_like(bias))))
        out[np.broadcast_to(hits > 0, out.shape)] = np.nan
        return out, lse, None


def _attend(inputs: AttentionInputs) -> tuple[Any, Any]:
    from ._plan import build, useful_threads
    from ._strategy import work
    from ._threads import get_num_threads, run_parallel

    threads = get_num_threads()  # a bad PORTATTN_NUMPY_THREADS fails here, clearly
    problem, units = build(inputs, threads)
    if units:
        run_parallel(lambda queue: work(problem, queue), units,
                     useful_threads(problem, units, threads),
                     first=lambda: problem.strategy.prepare(problem, units))
    return problem.out, problem.lse
