"""Reading the values held by masks: lengths checked wherever they can be read, and
kept in signed dtypes (arithmetic on unsigned lengths would wrap around)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_range", "dtype_text", "jax_tracer_type", "signed", "values_readable"]


def signed(xp: Any, lengths: Any) -> Any:
    """``lengths`` in a signed integer dtype (unsigned ones wrap around on subtraction)."""
    if not xp.isdtype(lengths.dtype, "unsigned integer"):
        return lengths
    bits = xp.iinfo(lengths.dtype).bits
    return xp.astype(lengths, xp.int32 if bits <= 16 else xp.int64)


def jax_tracer_type() -> type | None:
    """JAX's tracer class when JAX is imported (``jax.core`` itself may not be in
    ``sys.modules``: recent JAX loads it lazily)."""
    import sys

    jax = sys.modules.get("jax")
    core = getattr(jax, "core", None) if jax is not None else None
    return getattr(core, "Tracer", None)


def values_readable(a: Any) -> bool:
    """Whether ``a``'s values can be read now: not a lazy Dask graph, not a JAX tracer,
    not a tensor being compiled by torch.compile. Reading may sync a GPU."""
    import sys

    from array_api_compat import is_dask_array

    if is_dask_array(a):
        return False
    tracer = jax_tracer_type()
    if tracer is not None and isinstance(a, tracer):
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and isinstance(a, torch.Tensor)
                and torch.compiler.is_compiling())


def check_range(xp: Any, lengths: Any, limit: int, kind: str) -> None:
    """Lengths must lie in ``[0, limit]``, checked wherever the values are readable
    (traced and lazy arrays are not checked: there a length is clipped to the range)."""
    if math.prod(lengths.shape) == 0 or not values_readable(lengths):
        return
    try:
        bad = bool(xp.any(xp.logical_or(lengths < 0, lengths > limit)))
    except Exception:  # values that exist only while tracing, under a transformation
        return           # not recognised above: they cannot be read, as documented
    if not bad:
        return
    low, high = int(xp.min(lengths)), int(xp.max(lengths))
    length_name = "Lk" if kind == "key_lengths" else "Lq"
    msg = (f"{kind} lengths must lie in [0, {length_name}={limit}]; "
           f"got {kind} with min={low}, max={high}")
    raise ValueError(msg)


def dtype_text(dtype: Any) -> str:
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]
