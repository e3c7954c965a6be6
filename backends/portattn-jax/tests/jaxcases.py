"""Shared inputs for the JAX tests: the same call built on JAX and on float64 NumPy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from portattn import masks
from portattn.testing.plugin import require_backend


def with_host_devices(flags: str, count: int) -> str:
    """``XLA_FLAGS`` for a JAX process with ``count`` host devices: the other flags of
    ``flags`` kept (the suite's env sets some to compile faster), its device count
    replaced."""
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


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


def catalogue(convert: Any, batch: tuple[int, ...] = (2,), heads: int = 4, lq: int = 40,
              lk: int = 40, seed: int = 3) -> dict[str, Any]:
    """One mask of every kind (and the usual combinations) for a call of ``lq x lk``,
    arrays made by ``convert`` (the same draws for every ``convert``)."""
    rng = np.random.default_rng(seed)

    def lengths(limit: int) -> Any:
        return convert(rng.integers(0, limit + 1, batch))

    starts = rng.integers(0, lk // 2, batch)
    # packed documents: increasing runs with padding at the end of the row
    ids = np.repeat(np.arange(6), 9)[: max(lq, lk)]
    ids = np.stack([ids, np.roll(ids, 4)])[: int(np.prod(batch))].reshape(*batch, -1)
    ids[..., -3:] = -1
    kinds = {
        "causal": masks.causal(),
        "window": masks.sliding_window(5, 1),
        "key_lengths": masks.causal() & masks.key_lengths(lengths(lk)),
        "query_lengths": masks.query_lengths(lengths(lq)),
        "dense": masks.dense(convert(rng.random((*batch, heads, lq, lk)) < 0.5)),
        "key_ranges": masks.key_ranges(convert(starts), convert(starts + lk // 2)),
        "query_ranges": masks.query_ranges(convert(starts), lengths(lq)),
        "sequence_window": masks.sequence_window(6, 0, query_lengths=lengths(lq),
                                                 key_lengths=lengths(lk)),
        "documents": masks.causal() & masks.documents(convert(ids[..., :lq]),
                                                      convert(ids[..., :lk])),
        "shared_documents": masks.documents(convert(ids[0, :lq]), convert(ids[0, :lk])),
        "prefix_lm": masks.causal() | masks.prefix(lengths(lk)),
        "sink_tokens": masks.causal() & (masks.sliding_window(4) | masks.sink_tokens(3)),
        "window_or_global": masks.sliding_window(3) | masks.global_tokens(
            convert(np.array([0, lk // 2, -1]))),
        "global_per_batch": masks.global_tokens(convert(rng.integers(-1, lk, (*batch, 2)))),
        "chunks": masks.causal() & masks.chunks(12),
        "block_layout": masks.block_layout(
            convert(rng.random((heads, -(-lk // 8), -(-lk // 8))) < 0.4), 8),
        "function": masks.function(chunked_causal, args=()),
        "function_per_head": masks.function(per_batch_and_head, args=()),
        "documents_or_sinks": masks.documents(convert(ids[..., :lq]), convert(ids[..., :lk]))
        | masks.sink_tokens(2),
    }
    return kinds


def chunked_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
    return (q >= k) & (q // 12 == k // 12)


def per_batch_and_head(b: Any, h: Any, q: Any, k: Any) -> Any:
    return ((q - k) % (h + 2) == 0) | (k < 3 + 4 * b)
