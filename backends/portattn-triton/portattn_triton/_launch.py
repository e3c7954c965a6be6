"""Launching the Triton forward on torch tensors.

:func:`flash_forward` is the direct entry point (no dispatch, no validation beyond
shapes): it binds the mask to the call (:mod:`._plan`), picks a path (pointer kernel,
tensor-descriptor kernel, split-KV decode) and block sizes for the device (or takes
``path`` and ``config``), asks the block form on that grid and launches the kernel.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._configs import (
    DECODE_MAX_QUERIES,
    Config,
    autotune_candidates,
    block_dim,
    decode_max_rows,
    is_even,
    pick_config,
)
from ._distance import check_tiles
from ._launching import bias_strides, check_shapes, on_device, precision, tables
from ._plan import MaskPlan, plan_for
from ._poison import value_poison

if TYPE_CHECKING:
    import torch

    from portattn.masks import Mask
    from portattn.scores import ScoreChange

    from ._triton_dropout import Dropout

__all__ = ["PATHS", "flash_forward", "forward", "pick_path"]

#: The forward's three paths: the pointer kernel (any strides, any generation), the
#: tensor-descriptor kernel (Hopper, TMA-compatible strides) and split-KV decode.
PATHS = ("pointer", "tma", "decode")


def flash_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                  scale: float | None = None, softcap: float | None = None,
                  mask: Mask | None = None, causal: str | None = None,
                  window: tuple[int | None, int | None] | None = None,
                  key_lengths: torch.Tensor | None = None,
                  query_lengths: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None,
                  score_mod: ScoreChange | None = None,
                  config: Config | None = None, path: str | None = None,
                  autotune: bool = False, num_splits: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward on torch tensors; returns ``(out, lse)``.

    ``query (..., Hq, Lq, D)``, ``key (..., Hkv, Lk, D)``, ``value (..., Hkv, Lk, Dv)``
    with ``Hq % Hkv == 0``. ``mask`` is any ``portattn.masks`` mask; ``causal`` (an
    alignment name), ``window`` (a ``(left, right)`` pair, bottom-right aligned,
    inclusive), ``key_lengths`` and ``query_lengths`` (integer tensors of the batch
    shape) are shorthands for those kinds, all combined with ``&``. ``bias`` is an
    additive float tensor broadcastable to ``(..., Hq, Lq, Lk)``, added after the
    softcap, before the mask, in float32; ``score_mod`` a ``portattn.scores`` change
    whose entries follow the distance ``j - i`` (``relative_position``, ``alibi`` and
    their sums), added beside the bias.
    ``lse`` is float32. ``path`` forces one of :data:`PATHS` (None: :func:`pick_path`);
    ``config`` fixes the block sizes instead of the table's, ``autotune=True`` times
    :func:`~portattn_triton.autotune_candidates` on the first call of each kind instead
    (pointer and tensor-descriptor paths, on a GPU). ``num_splits`` fixes how many
    key slices the decode path spreads over (None: enough to fill the device).
    """
    check_shapes(query, key, value)
    plan = plan_for(query, key, mask=mask, causal=causal, window=window,
                    key_lengths=key_lengths, query_lengths=query_lengths, bias=bias,
                    score_mod=score_mod)
    return forward(query, key, value, plan, scale=scale, softcap=softcap, config=config,
                   path=path, autotune=autotune, num_splits=num_splits)


def forward(query: Any, key: Any, value: Any, plan: MaskPlan, *, scale: float | None,
            softcap: float | None, config: Config | None = None, path: str | None = None,
            autotune: bool = False, num_splits: int | None = None,
            dropout: Dropout | None = None) -> tuple[Any, Any]:
    """:func:`flash_forward` with the mask and bias already planned; ``dropout`` (a
    :class:`~._triton_dropout.Dropout`) runs on the pointer path."""
    import torch

    *batch, hq, lq, d = query.shape
    hkv, lk, dv = key.shape[-3], key.shape[-2], value.shape[-1]
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
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    q = query.reshape(z, hq, lq, d)
    k = key.reshape(z, hkv, lk, d)
    v = value.reshape(z, hkv, lk, dv)
    if dropout is not None and path not in (None, "pointer"):
        msg = f"dropout runs on the pointer path; got path={path!r}"
        raise ValueError(msg)
    if dropout is not None:
        path = "pointer"
    if path is None:  # a fixed config is a forward tile: decode only when asked by name
        path = pick_path(capability, q, k, v, decode=config is None)
    poison = value_poison(v, plan.cut)
    if path == "decode":
        from ._launch_decode import decode_forward

        out, lse = decode_forward(q, k, v, scale, softcap, plan, poison, capability, config,
                                  num_splits)
        return out.view(*batch, hq, lq, dv), lse.view(*batch, hq, lq)

    out = torch.empty((*batch, hq, lq, dv), dtype=query.dtype, device=dev)
    lse = torch.empty((*batch, hq, lq), dtype=torch.float32, device=dev)
    o = out.view(z, hq, lq, dv)
    lower, upper = plan.band
    kl, ql = plan.key_lengths, plan.query_lengths
    scalars = (hq, hq // hkv, lq, lk)
    factors = (scale, 1.0 if softcap is None else float(softcap),
               0 if lower is None else lower, 0 if upper is None else upper)
    flags = {"BLOCK_D": block_dim(d), "BLOCK_DV": block_dim(dv),
             "HAS_LOWER": lower is not None, "HAS_UPPER": upper is not None,
             "HAS_KEY_LENGTHS": kl is not None, "HAS_QUERY_LENGTHS": ql is not None,
             "HAS_POISON": poison is not None, "HAS_BIAS": plan.bias is not None,
             "HAS_DISTANCE": plan.distance is not None,
             "SOFTCAP": softcap is not None, "REVERSE": upper is not None and lower is None,
             "INPUT_PRECISION": precision(query.dtype)}
    dummy = lse  # stands in for absent optional tensors; never read
    drop_args = (dummy, 0, 1.0) if dropout is None else dropout.arguments()
    if path == "pointer":
        flags["EVEN_D"] = is_even(d, dv)
        flags["DROPOUT"] = dropout is not None

    def launch(c: Config) -> None:
        if plan.distance is not None:
            check_tiles(c.block_m, c.block_n)
        table, table_args, bits, has_bits = tables(plan, c.block_m, c.block_n, dummy)
        tensors = (*(dummy if t is None else t for t in (kl, ql, poison)), table,
                   bits, dummy if plan.bias is None else plan.bias,
                   dummy if plan.distance is None else plan.distance.values)
        sizes = {**flags, "HAS_BITS": has_bits, "HAS_TABLE": plan.needs_table,
                 "BLOCK_M": c.block_m, "BLOCK_N": c.block_n}
        common = (*tensors, *bias_strides(plan.bias), *table_args, *scalars)
        if path == "tma":
            from ._launch_tma import launch_tma

            launch_tma(q, k, v, o, lse, common, factors, sizes, c)
            return
        from ._triton_kernel import flash_forward_kernel

        flash_forward_kernel[(z * hq, math.ceil(lq / c.block_m))](
            q, k, v, o, lse, *tensors, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            *bias_strides(plan.bias), *table_args, *scalars, d, dv, *factors, *drop_args,
            **sizes, num_warps=c.num_warps, num_stages=c.num_stages)

    with on_device(dev):
        if config is None and autotune and capability is not None:
            from ._autotune import tuned

            kind = (path, capability, query.element_size(), d, dv,
                    tuple(sorted(flags.items())), plan.rest is not None)
            config = tuned(kind, autotune_candidates(capability, query.element_size(), d, dv),
                           launch)
        elif config is None:
            config = pick_config(capability, query.element_size(), d, dv,
                                 extra="dropout" if dropout is not None else plan.extra)
        launch(config)
    return out, lse


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
