"""What every launcher of the Triton kernels (forward, decode, backward) shares: the
shape check, the block form's tables on a kernel's grid, bias strides, the float32
product precision and the device context."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._plan import MaskPlan

__all__ = ["bias_strides", "check_shapes", "on_device", "precision", "tables"]


def check_shapes(query: Any, key: Any, value: Any) -> None:
    """Raise when ``(Z, H, L, D)`` query, key and value cannot make one call."""
    hq, d = query.shape[-3], query.shape[-1]
    hkv, lk = key.shape[-3], key.shape[-2]
    if key.shape[-1] != d or value.shape[-2] != lk or (hq % hkv if hkv else hq):
        msg = (f"incompatible shapes: query.shape={tuple(query.shape)}, "
               f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}")
        raise ValueError(msg)


def tables(plan: MaskPlan, block_q: int, block_k: int, dummy: Any,
           columns: bool = False) -> tuple[Any, tuple[int, ...], Any, bool]:
    """``(table, table arguments, bits, whether any tile has bits)`` of a kernel's grid:
    the rows per query block (``columns``: per key block), or ``dummy`` and zeros when
    the plan needs no table."""
    if not plan.needs_table:
        return dummy, (0, 0, 0, 0), dummy, False
    grid = plan.grid(block_q, block_k)
    table, *table_args = grid.columns if columns else grid.rows
    return table, tuple(table_args), grid.bits, grid.has_bits


def bias_strides(bias: Any) -> tuple[int, ...]:
    """The strides a kernel reads ``bias (Z, H, Lq, Lk)`` with (0 for broadcast axes)."""
    return (0, 0, 0, 0) if bias is None else tuple(bias.stride())


def precision(dtype: Any) -> str:
    """float32: three TF32 products per product (about float32 accuracy on tensor
    cores) unless torch is told that plain TF32 will do."""
    import torch

    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def on_device(dev: Any) -> Any:
    import contextlib

    import torch

    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
