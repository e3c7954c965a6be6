"""Shared inputs for the JAX tests: the same call built on JAX and on float64 NumPy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from portattn import masks
from portattn.testing.plugin import require_backend


def jax_backend() -> Any:
    """The test backend ``jax`` (x64 enabled), by the harness's rule: skips when JAX is
    unselected (or absent with no selection), fails when selected but absent."""
    return require_backend("jax")


@dataclass(frozen=True)
class Shapes:
    batch: tuple[int, ...] = (2,)
    hq: int = 4
    hkv: int = 2
    lq: int = 7
    lk: int = 9
    d: int = 8
    dv: int = 8


def arrays(shapes: Shapes, dtype: str, seed: int = 0) -> tuple[tuple, tuple]:
    """Query, key, value on JAX in ``dtype`` and the same values as float64 NumPy."""
    backend = jax_backend()
    rng = np.random.default_rng(seed)
    s = shapes
    dims = ((*s.batch, s.hq, s.lq, s.d), (*s.batch, s.hkv, s.lk, s.d),
            (*s.batch, s.hkv, s.lk, s.dv))
    on_jax = tuple(backend.asarray(rng.standard_normal(shape), dtype) for shape in dims)
    return on_jax, tuple(np.asarray(backend.to_numpy(a), dtype=np.float64) for a in on_jax)


def mask_pair(name: str, shapes: Shapes, seed: int = 1) -> tuple[Any, Any]:
    """Mask ``name`` built on JAX and on NumPy from the same draws (None for ``none``)."""
    backend = jax_backend()
    return _mask(name, shapes, seed, backend.asarray), _mask(name, shapes, seed, np.asarray)


def _mask(name: str, s: Shapes, seed: int, convert: Any) -> Any:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, s.lk + 1, size=s.batch)
    if name == "none":
        return None
    if name == "causal":
        return masks.causal()
    if name == "causal_top_left":
        return masks.causal("top_left")
    if name == "window":
        return masks.sliding_window(2, 1)
    if name == "key_lengths":
        return masks.key_lengths(convert(lengths))
    if name == "causal_and_key_lengths":
        return masks.causal() & masks.key_lengths(convert(lengths))
    if name == "query_lengths":
        return masks.query_lengths(convert(rng.integers(0, s.lq + 1, size=s.batch)))
    if name == "dense":
        return masks.dense(convert(rng.random((*s.batch, s.hq, s.lq, s.lk)) < 0.4))
    msg = f"unknown mask name {name!r}"
    raise ValueError(msg)


MASK_NAMES = ("none", "causal", "causal_top_left", "window", "key_lengths",
              "causal_and_key_lengths", "query_lengths", "dense")
