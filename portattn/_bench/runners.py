"""What the benchmark times: every installed kernel, plus two baselines that are not.

A kernel runs through :func:`portattn.attention` with ``kernel=name`` (what a user
calls), and whether it can run a case is asked of :func:`portattn.explain`, so a new
plugin shows up here without any change. The baselines are the yardsticks: the
textbook NumPy formula on the whole score matrix, and PyTorch's own
``scaled_dot_product_attention`` called directly.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from .backends import BenchBackend

__all__ = ["BASELINES", "KernelRunner", "Runner", "all_runners"]


class Runner:
    """Something the sweep can time on one backend."""

    name: str = ""
    kind: str = ""
    provenance: str = ""

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
        # What explain() says about this one kernel, without checking all the others
        # (their availability checks would import every array library).
        from portattn._dispatch import reasons
        from portattn._inputs import describe
        from portattn._registry import kernel_entries

        for entry in kernel_entries():
            if entry.name == self.name:
                return reasons(entry, describe(q, k, v, mask=_mask(causal)))
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


BASELINES: tuple[Runner, ...] = (TextbookNumpy(), TorchSdpa())
SDPA_BASELINE = TorchSdpa.name


def all_runners() -> list[Runner]:
    """Every installed kernel (dispatch order, unusable ones included) and the baselines."""
    import portattn

    kernels = [KernelRunner(e.name, e.provenance) for e in portattn.kernels()]
    return [*kernels, *BASELINES]
