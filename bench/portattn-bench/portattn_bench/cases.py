"""The sweep grid: which runner, on which backend, at which length, mask and dtype.

Planning asks each runner about each (backend, dtype, mask) on tiny arrays, so
combinations that can never run (a NumPy kernel on torch tensors) are recorded with
their reasons instead of being timed; the real-size check happens again at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import backends as _backends
from .work import attention_flops, causal_pairs

if TYPE_CHECKING:
    from .backends import BenchBackend
    from .runners import Runner

__all__ = ["Case", "Shape", "SweepConfig", "attention_flops", "causal_pairs", "flops", "plan"]

DEFAULT_SIZES = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SIZES = (256, 512)
PROBE_LENGTH = 16


@dataclass(frozen=True)
class Shape:
    """Everything about the inputs but the sequence length."""

    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    value_head_dim: int = 64

    def arrays(self, length: int) -> tuple[Any, Any, Any]:
        """float32 NumPy query, key, value with ``Lq == Lk == length`` (seeded)."""
        import numpy as np

        rng = np.random.default_rng(length)
        lead = (self.batch, self.heads, length)
        return (rng.standard_normal((*lead, self.head_dim), dtype=np.float32),
                rng.standard_normal((*lead, self.head_dim), dtype=np.float32),
                rng.standard_normal((*lead, self.value_head_dim), dtype=np.float32))


@dataclass(frozen=True)
class SweepConfig:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    backends: tuple[str, ...] = ("numpy",)
    kernels: tuple[str, ...] | None = None
    """Runner names to keep (kernels and baselines); None keeps all."""
    dtypes: tuple[str, ...] = ("float32",)
    masks: tuple[bool, ...] = (False, True)
    """Causal or not."""
    device: str = "cpu"
    shape: Shape = field(default_factory=Shape)
    repeat: int = 5
    warmup: int = 1
    max_time: float = 30.0
    """Skip a case whose single call is predicted to take longer (seconds)."""
    budget: float = 60.0
    """Stop repeating a case once this many seconds were spent on it."""
    max_memory: float | None = None
    """Skip a case whose peak memory is predicted above this (bytes); None: no limit."""


def flops(shape: Shape, q_len: int, kv_len: int, causal: bool) -> int:
    """Two GEMMs, 2 flops per multiply-add: ``2*B*H*pairs*(D + Dv)``."""
    pairs = causal_pairs(q_len, kv_len) if causal else q_len * kv_len
    return 2 * shape.batch * shape.heads * pairs * (shape.head_dim + shape.value_head_dim)


@dataclass(frozen=True)
class Case:
    runner: Runner
    backend: BenchBackend
    dtype: str
    causal: bool
    length: int
    shape: Shape

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "none"

    @property
    def series(self) -> tuple[str, str, str, str]:
        """Cases that differ only in length: one line on the plot."""
        return (self.runner.name, str(self.backend), self.dtype, self.mask)

    @property
    def flops(self) -> int:
        return self.runner.work(flops(self.shape, self.length, self.length, self.causal))

    def __str__(self) -> str:
        return f"{self.runner}-{self.backend}-{self.dtype}-{self.mask}-L{self.length}"


@dataclass(frozen=True)
class Plan:
    cases: list[Case]
    """Cases to run, length-major (so each series grows in order)."""
    unsupported: list[dict[str, Any]]
    """Series that can never run here, with the reasons (JSON-ready)."""
    notes: list[str]
    """Backends left out, and why."""


def select_runners(runners: list[Runner], names: tuple[str, ...] | None) -> list[Runner]:
    if names is None:
        return runners
    known = {r.name: r for r in runners}
    missing = [n for n in names if n not in known]
    if missing:
        msg = (f"--kernels names unknown kernels {', '.join(missing)}; "
               f"installed kernels and baselines: {', '.join(known)}")
        raise ValueError(msg)
    return [known[n] for n in names]


def plan(config: SweepConfig, runners: list[Runner]) -> Plan:
    """Every case of the grid, sorted into runnable and never-runnable."""
    runners = select_runners(runners, config.kernels)
    notes: list[str] = []
    usable: list[tuple[BenchBackend, str, bool, Runner]] = []
    unsupported: list[dict[str, Any]] = []
    for name in config.backends:
        backend = _backends.get(name, config.device)
        why = _backends.unavailable_reason(name, config.device)
        if why is not None:
            notes.append(f"backend {backend} left out: {why}")
            continue
        for dtype in config.dtypes:
            dtype_why = backend.dtype_reason(dtype)
            probe = None if dtype_why else _probe_arrays(backend, dtype, config.shape)
            for causal in config.masks:
                for runner in runners:
                    why_not = [dtype_why] if dtype_why else runner.reasons(
                        backend, *probe, causal)
                    if why_not:
                        unsupported.append({
                            "runner": runner.name, "kind": runner.kind,
                            "backend": str(backend), "device": backend.device,
                            "dtype": dtype, "mask": "causal" if causal else "none",
                            "reasons": why_not})
                    else:
                        usable.append((backend, dtype, causal, runner))
    cases = [Case(runner, backend, dtype, causal, length, config.shape)
             for length in config.sizes for backend, dtype, causal, runner in usable]
    return Plan(cases, unsupported, notes)


def _probe_arrays(backend: BenchBackend, dtype: str, shape: Shape) -> tuple[Any, Any, Any]:
    return tuple(backend.asarray(a, dtype) for a in shape.arrays(PROBE_LENGTH))
