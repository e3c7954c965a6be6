"""The ``numpy_fast`` kernel: declarations, and the call that runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from portattn.kernel import Kernel
from portattn.masks import KINDS

from ._config import current

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
        # NumPy loads with the first call, not when portattn discovers the kernel
        from ._call import attend

        config = current()  # read once, here: the worker threads see the same settings
        # the tuned size is read on the calling thread, where a tune run sets its trial
        tuned = None if config.tile_bytes is not None else self.tuned("tile_bytes")
        return (*attend(inputs, config, config.score_tile_bytes(tuned)), None)
