"""What the benchmark times: every installed kernel, two baselines that are not, and
the machine's GEMM rate as a reference.

A kernel runs through :func:`portattn.attention` with ``kernel=name`` (what a user
calls), and whether it can run a case is asked of :func:`portattn.explain`, so a new
plugin shows up here without any change. The baselines are the yardsticks: the
textbook NumPy formula on the whole score matrix, and PyTorch's own
``scaled_dot_product_attention`` called directly. The reference is NumPy's own float32
GEMM (BLAS) on square matrices holding as much work as each case: the rate this
machine reaches on that much matrix product, and the time a kernel at that rate takes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from .backends import BenchBackend

__all__ = ["BASELINES", "SGEMM", "KernelRunner", "Runner", "all_runners"]


class Runner:
    """Something the sweep can time on one backend."""

    name: str = ""
    kind: str = ""
    provenance: str = ""
    settle: float = 0.0
    """Seconds of idling before the case (see :func:`~portattn_bench.measure.measure`)."""
    min_time: float = 0.0
    """Seconds of timed calls at least, the best of which is reported."""

    def reasons(self, backend: BenchBackend, q: Any, k: Any, v: Any, causal: bool) -> list[str]:
        """Why this runner cannot run the case (empty when it can)."""
        raise NotImplementedError

    def prepare(self, backend: BenchBackend, q: Any, k: Any, v: Any,
                causal: bool) -> Callable[[], Any]:
        """A call with no arguments that computes the attention output."""
        raise NotImplementedError

    def work(self, flops: int) -> int:
        """The FLOPs it performs for a case of ``flops`` attention FLOPs."""
        return flops

    def __str__(self) -> str:
        return self.name


def _mask(causal: bool) -> Any:
    from portattn import masks

    return masks.causal() if causal else None


class KernelRunner(Runner):
    kind = "kernel"

    def __init__(self, name: str, provenance: str) -> None:
        self.name = name
        self.provenance = provenance

    def reasons(self, backend: BenchBackend, q: Any, k: Any, v: Any, causal: bool) -> list[str]:
        # What explain() says about this kernel (it asks only the kernels that target
        # the arrays' library whether they are available, so no other library loads).
        import portattn

        for entry, why in portattn.explain(q, k, v, mask=_mask(causal)).candidates:
            if entry.name == self.name:
                return list(why)
        return [f"kernel {self.name!r} is not installed"]

    def prepare(self, backend: BenchBackend, q: Any, k: Any, v: Any,
                causal: bool) -> Callable[[], Any]:
        import portattn

        mask, name = _mask(causal), self.name
        return lambda: portattn.attention(q, k, v, mask=mask, kernel=name)


class TextbookNumpy(Runner):
    """``softmax(Q K^T / sqrt(d)) V`` with the whole score matrix, as in a textbook."""

    name = "numpy_textbook"
    kind = "baseline"
    provenance = "baseline"

    def reasons(self, backend: BenchBackend, q: Any, k: Any, v: Any, causal: bool) -> list[str]:
        if backend.name != "numpy":
            return [f"backend={backend} (runs on numpy arrays only)"]
        return []

    def prepare(self, backend: BenchBackend, q: Any, k: Any, v: Any,
                causal: bool) -> Callable[[], Any]:
        import numpy as np

        lq, lk = q.shape[-2], k.shape[-2]
        # Built once, as a user would: True above the (bottom-right) diagonal = hidden.
        hidden = np.triu(np.ones((lq, lk), dtype=bool), k=lk - lq + 1) if causal else None
        scale = 1.0 / math.sqrt(q.shape[-1])

        def textbook() -> Any:
            s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
            if hidden is not None:
                s = np.where(hidden, -np.inf, s).astype(q.dtype, copy=False)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            return (p / p.sum(axis=-1, keepdims=True)) @ v

        return textbook


class TorchSdpa(Runner):
    """``torch.nn.functional.scaled_dot_product_attention`` on torch tensors, directly."""

    name = "torch_sdpa_direct"
    kind = "baseline"
    provenance = "baseline"

    def reasons(self, backend: BenchBackend, q: Any, k: Any, v: Any, causal: bool) -> list[str]:
        if backend.name != "torch":
            return [f"backend={backend} (runs on torch tensors only)"]
        return []

    def prepare(self, backend: BenchBackend, q: Any, k: Any, v: Any,
                causal: bool) -> Callable[[], Any]:
        import torch.nn.functional as F

        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class NumpySgemm(Runner):
    """NumPy's float32 GEMM on square ``n x n`` matrices holding the case's work.

    ``n`` is chosen so that ``2 n^3`` equals the attention case's FLOP count (the
    allowed pairs only, under a causal mask), so its time is what a kernel running at
    this machine's sgemm rate would take, and its GFLOP/s is that rate at this size.

    Other work can only slow a GEMM down, and a slowed reference inflates every
    kernel's share of it: it is timed after the previous case's threads went idle, as
    the best of calls over a quarter second.
    """

    name = "numpy_sgemm"
    kind = "reference"
    provenance = "reference"
    settle = 0.25
    min_time = 0.25

    def reasons(self, backend: BenchBackend, q: Any, k: Any, v: Any, causal: bool) -> list[str]:
        if backend.name != "numpy":
            return [f"backend={backend} (runs on numpy arrays only)"]
        if str(q.dtype) != "float32":
            return [f"dtype={q.dtype} (the reference is float32 GEMM)"]
        return []

    def work(self, flops: int) -> int:
        return 2 * side(flops) ** 3

    def prepare(self, backend: BenchBackend, q: Any, k: Any, v: Any,
                causal: bool) -> Callable[[], Any]:
        import numpy as np

        from .work import attention_flops

        n = side(attention_flops(q.shape, k.shape, v.shape, causal))
        rng = np.random.default_rng(n)
        a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        out = np.empty_like(a)
        return lambda: np.matmul(a, b, out=out)


def side(flops: int) -> int:
    """The side of the square GEMM (``2 n^3`` flops) nearest to ``flops``."""
    return max(1, round((flops / 2) ** (1 / 3)))


BASELINES: tuple[Runner, ...] = (TextbookNumpy(), TorchSdpa())
SGEMM = NumpySgemm()
SDPA_BASELINE = TorchSdpa.name


def all_runners() -> list[Runner]:
    """Every installed kernel (dispatch order, unusable ones included), the baselines and
    the sgemm reference."""
    import portattn

    kernels = [KernelRunner(e.name, e.provenance) for e in portattn.kernels()]
    return [*kernels, *BASELINES, SGEMM]
