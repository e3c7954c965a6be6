"""Launching the Triton kernel on torch tensors.

:func:`flash_forward` is the direct entry point (no dispatch, no validation beyond
shapes): it flattens the leading batch dims, turns the positional masks into a band on
``j - i``, picks a path (pointer kernel, tensor-descriptor kernel, split-KV decode)
and block sizes for the device (or takes ``path`` and ``config``) and launches it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._configs import (
    DECODE_MAX_QUERIES,
    Config,
    block_dim,
    decode_max_rows,
    is_even,
    pick_config,
)

if TYPE_CHECKING:
    import torch

__all__ = ["PATHS", "band", "cut_keys", "flash_forward", "not_finite", "pick_path",
           "value_poison"]

_ALIGNMENTS = ("bottom_right", "top_left")


Band = tuple[int | None, int | None]


def band(q_len: int, kv_len: int, causal: str | None = None,
         window: tuple[int | None, int | None] | None = None,
         within: Band = (None, None)) -> Band:
    """``(lower, upper)`` such that query ``i`` may attend key ``j`` iff
    ``lower <= j - i <= upper`` (None: unbounded on that side), intersected with
    ``within``."""
    shift = kv_len - q_len  # bottom-right alignment
    lower, upper = within
    if causal is not None:
        if causal not in _ALIGNMENTS:
            msg = f"causal must be None, 'bottom_right' or 'top_left'; got causal={causal!r}"
            raise ValueError(msg)
        high = shift if causal == "bottom_right" else 0
        upper = high if upper is None else min(upper, high)
    if window is not None:
        left, right = window
        if left is not None:
            lower = shift - left if lower is None else max(lower, shift - left)
        if right is not None:
            upper = shift + right if upper is None else min(upper, shift + right)
    return lower, upper


#: The forward's three paths: the pointer kernel (any strides, any generation), the
#: tensor-descriptor kernel (Hopper, TMA-compatible strides) and split-KV decode.
PATHS = ("pointer", "tma", "decode")


def flash_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                  scale: float | None = None, softcap: float | None = None,
                  causal: str | None = None,
                  window: tuple[int | None, int | None] | None = None,
                  band_offsets: Band = (None, None),
                  key_lengths: torch.Tensor | None = None,
                  query_lengths: torch.Tensor | None = None,
                  config: Config | None = None, path: str | None = None,
                  autotune: bool = False, num_splits: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward on torch tensors; returns ``(out, lse)``.

    ``query (..., Hq, Lq, D)``, ``key (..., Hkv, Lk, D)``, ``value (..., Hkv, Lk, Dv)``
    with ``Hq % Hkv == 0``. ``causal`` is an alignment name, ``window`` a
    ``(left, right)`` pair (bottom-right aligned, inclusive), ``band_offsets`` a
    ``(lower, upper)`` band on ``j - i`` (see :func:`band`), ``key_lengths`` /
    ``query_lengths`` integer tensors of the batch shape.
    ``lse`` is float32. ``path`` forces one of :data:`PATHS` (None: :func:`pick_path`);
    ``config`` fixes the block sizes instead of the table's, ``autotune=True`` times
    :func:`~portattn_triton.autotune_candidates` on the first call of each kind instead
    (pointer and tensor-descriptor paths, on a GPU). ``num_splits`` fixes how many
    key slices the decode path spreads over (None: enough to fill the device).
    """
    import torch

    *batch, hq, lq, d = query.shape
    hkv, lk, dv = key.shape[-3], key.shape[-2], value.shape[-1]
    if key.shape[-1] != d or value.shape[-2] != lk or hq % hkv:
        msg = (f"incompatible shapes: query.shape={tuple(query.shape)}, "
               f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}")
        raise ValueError(msg)
    if path is not None and path not in PATHS:
        msg = f"path must be None or one of {', '.join(PATHS)}; got path={path!r}"
        raise ValueError(msg)
    if autotune and config is not None:
        msg = "pass either config or autotune=True, not both"
        raise ValueError(msg)
    z = math.prod(batch)
    dev = query.device
    if z == 0 or hq == 0 or lq == 0 or lk == 0:  # nothing to attend: 0 and -inf
        return (torch.zeros((*batch, hq, lq, dv), dtype=query.dtype, device=dev),
                torch.full((*batch, hq, lq), -math.inf, dtype=torch.float32, device=dev))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lower, upper = band(lq, lk, causal, window, band_offsets)
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    q = query.reshape(z, hq, lq, d)
    k = key.reshape(z, hkv, lk, d)
    v = value.reshape(z, hkv, lk, dv)
    if path is None:  # a fixed config is a forward tile: decode only when asked by name
        path = pick_path(capability, q, k, v, decode=config is None)
    kl = _lengths(key_lengths, z)
    ql = _lengths(query_lengths, z)
    poison = value_poison(v, lower, upper, lq)
    if path == "decode":
        from ._launch_decode import decode_forward

        out, lse = decode_forward(q, k, v, scale, softcap, lower, upper, kl, ql, poison,
                                  capability, config, num_splits)
        return out.view(*batch, hq, lq, dv), lse.view(*batch, hq, lq)

    out = torch.empty((*batch, hq, lq, dv), dtype=query.dtype, device=dev)
    lse = torch.empty((*batch, hq, lq), dtype=torch.float32, device=dev)
    o = out.view(z, hq, lq, dv)
    if config is None and not autotune:
        config = pick_config(capability, query.element_size(), d, dv)
    dummy = lse  # stands in for absent optional tensors; never read
    scalars = (hq, hq // hkv, lq, lk)
    factors = (scale, 1.0 if softcap is None else float(softcap),
               0 if lower is None else lower, 0 if upper is None else upper)
    flags = {"BLOCK_D": block_dim(d), "BLOCK_DV": block_dim(dv),
             "HAS_LOWER": lower is not None, "HAS_UPPER": upper is not None,
             "HAS_KEY_LENGTHS": kl is not None, "HAS_QUERY_LENGTHS": ql is not None,
             "HAS_POISON": poison is not None, "SOFTCAP": softcap is not None,
             "REVERSE": upper is not None and lower is None,
             "INPUT_PRECISION": _precision(query.dtype)}
    optional = tuple(dummy if t is None else t for t in (kl, ql, poison))
    with _on_device(dev):
        if path == "tma":
            from ._launch_tma import launch_tma

            launch_tma(q, k, v, o, lse, optional, scalars, factors, flags, config,
                       capability if autotune else None)
            return out, lse
        from ._triton_kernel import flash_forward_kernel

        args = (q, k, v, o, lse, *optional, *q.stride(), *k.stride(), *v.stride(),
                *o.stride(), *scalars, d, dv, *factors)
        flags["EVEN_D"] = is_even(d, dv)
        if autotune:
            from ._launch_tma import autotuned

            kernel = autotuned(flash_forward_kernel, capability, query.element_size(), d, dv)
            kernel[lambda meta: (z * hq, math.ceil(lq / meta["BLOCK_M"]))](*args, **flags)
        else:
            flash_forward_kernel[(z * hq, math.ceil(lq / config.block_m))](
                *args, **flags, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                num_warps=config.num_warps, num_stages=config.num_stages)
    return out, lse


#: The widest key tile of any path, forward or backward.
MAX_BLOCK_N = 256


def cut_keys(lower: int | None, upper: int | None, q_len: int,
             kv_len: int) -> tuple[int, int] | None:
    """The keys ``[a, b)`` that the band hides from some row while a tile the kernels
    read holds them (None: there are none), a superset for any tile size.

    A hidden key still meets its weight 0 in a tile's products, and ``0 * NaN`` is NaN.
    Keys hidden by the lower bound are the first ``q_len - 1 + lower``, read from the
    first tile the band reaches; keys hidden by the upper bound come after ``upper``,
    read up to the last tile it reaches. So ``O(q_len + MAX_BLOCK_N)`` keys a side,
    and none for a decode step under a causal mask. (Keys past the lengths are never
    read by the forward and zeroed before the backward.)
    """
    spans = []
    if lower is not None:
        spans.append((max(lower, 0) // MAX_BLOCK_N * MAX_BLOCK_N,
                      min(q_len - 1 + lower, kv_len)))
    if upper is not None:
        spans.append((max(upper + 1, 0),
                      min(-(-(q_len + upper) // MAX_BLOCK_N) * MAX_BLOCK_N, kv_len)))
    spans = [(a, b) for a, b in spans if a < b]
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)


def not_finite(x: Any, a: int, b: int) -> Any:
    """``(Z, H, L)`` float32: NaN where row ``j`` of ``x (Z, H, L, E)`` holds NaN or inf,
    for ``a <= j < b``, 0 elsewhere. One pass over those rows: a row's extremes are
    both finite iff all of it is, and ``0 * y`` is 0 for finite ``y``, NaN otherwise."""
    import torch

    flags = torch.zeros(x.shape[:3], dtype=torch.float32, device=x.device)
    low, high = torch.aminmax(x[..., a:b, :], dim=-1)
    flags[..., a:b] = low.float() * 0 + high.float() * 0
    return flags


def value_poison(v: Any, lower: int | None, upper: int | None, q_len: int) -> Any:
    """The forward kernels' ``Poison`` (None when no key needs it): NaN for each cut key
    (:func:`cut_keys`) whose value row is not finite. In masked tiles they load such
    values as 0 and make their keys score NaN (see ``fold_tile``), so exactly the rows
    that attend such a value come out NaN, in every column. (A non-finite key needs
    nothing: its scores are replaced where hidden.)"""
    cut = cut_keys(lower, upper, q_len, v.shape[2])
    return None if cut is None else not_finite(v, *cut)


def pick_path(capability: tuple[int, int] | None, query: Any, key: Any, value: Any, *,
              decode: bool = True) -> str:
    """The forward path for these ``(Z, H, L, D)`` tensors on a device of
    ``capability`` (None: the interpreter): ``decode`` (unless ``decode=False``) for
    a few queries whose rows per K/V head fit one tile, ``tma`` on Hopper when the
    strides allow tensor descriptors, ``pointer`` otherwise."""
    hq, lq = query.shape[-3], query.shape[-2]
    rows = lq * (hq // key.shape[-3])
    size = query.element_size()
    dim = max(block_dim(query.shape[-1]), block_dim(value.shape[-1]))
    if decode and lq <= DECODE_MAX_QUERIES and rows <= decode_max_rows(size, dim):
        return "decode"
    # float32 at head dim 256 spills in the descriptor kernel: the pointer kernel does not
    if capability is not None and capability[0] >= 9 and (size <= 2 or dim <= 128):
        from ._launch_tma import tma_reasons

        if not tma_reasons(query, key, value):
            return "tma"
    return "pointer"


def _precision(dtype: Any) -> str:
    """float32: three TF32 products per product (about float32 accuracy on tensor
    cores) unless torch is told that plain TF32 will do."""
    import torch

    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def _lengths(x: Any, z: int) -> Any:
    if x is None:
        return None
    import torch

    return x.reshape(z).to(torch.int32)


def _on_device(dev: Any) -> Any:
    import contextlib

    import torch

    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
