"""What the benchmark times: every installed kernel, two baselines that are not, and
the machine's GEMM rate as a reference.

A kernel runs through :func:`portattn.attention` with ``kernel=name`` (what a user
calls), and whether it can run a case is asked of :func:`portattn.explain`, so a new
plugin shows up here without any change. The baselines are the yardsticks: the
textbook NumPy formula on the whole score matrix, and PyTorch's own
``scaled_dot_product_attention`` called directly. The reference is NumPy's own float32
GEMM on the two products attention is made of (``Q K^T`` and ``S V``, whole score
matrix): the rate this machine's BLAS reaches at the report's sizes.
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
    counts_mask: bool = True
    """Whether its FLOP count is that of the allowed (query, key) pairs only."""

    def reasons(self, backend: BenchBackend, q: Any, k: Any, v: Any, causal: bool) -> list[str]:
        """Why this runner cannot run the case (empty when it can)."""
        raise NotImplementedError

    def prepare(self, backend: BenchBackend, q: Any, k: Any, v: Any,
                causal: bool) -> Callable[[], Any]:
        """A call with no arguments that computes the attention output."""
        raise NotImplementedError

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
    """The two float32 GEMMs of unmasked attention, ``(Q K^T) V``, by NumPy's BLAS.

    Its FLOP count is always that of the full products (a mask does not shrink a GEMM),
    so its GFLOP/s is the machine's sgemm rate at this size, mask or not.
    """

    name = "numpy_sgemm"
    kind = "reference"
    provenance = "reference"
    counts_mask = False

    def reasons(self, backend: BenchBackend, q: Any, k: Any, v: Any, causal: bool) -> list[str]:
        if backend.name != "numpy":
            return [f"backend={backend} (runs on numpy arrays only)"]
        if str(q.dtype) != "float32":
            return [f"dtype={q.dtype} (the reference is float32 GEMM)"]
        return []

    def prepare(self, backend: BenchBackend, q: Any, k: Any, v: Any,
                causal: bool) -> Callable[[], Any]:
        import numpy as np

        kt = np.ascontiguousarray(np.swapaxes(k, -1, -2))  # as a kernel would lay it out
        return lambda: np.matmul(np.matmul(q, kt), v)


BASELINES: tuple[Runner, ...] = (TextbookNumpy(), TorchSdpa())
SGEMM = NumpySgemm()
SDPA_BASELINE = TorchSdpa.name


def all_runners() -> list[Runner]:
    """Every installed kernel (dispatch order, unusable ones included), the baselines and
    the sgemm reference."""
    import portattn

    kernels = [KernelRunner(e.name, e.provenance) for e in portattn.kernels()]
    return [*kernels, *BASELINES, SGEMM]
