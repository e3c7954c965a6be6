"""Reading the values masks hold: integer arrays checked wherever they can be read,
kept in signed dtypes (arithmetic on unsigned lengths would wrap around), and copied
to the host once so a block form can follow them.

Values cannot be read while JAX traces, inside torch.compile, or from a lazy Dask
graph; there the masks keep no copy and the kernels visit every tile the structure
alone does not rule out, which stays correct. Reading an array on an accelerator waits
for it. A leaf module: it imports nothing else of portattn.
"""

from __future__ import annotations

import math
import sys
from typing import Any

__all__ = ["check_array", "check_bounds", "check_integer_array", "check_range", "dtype_text",
           "host_copy", "jax_tracer_type", "signed", "torch_compiling", "values_readable"]


def signed(xp: Any, lengths: Any) -> Any:
    """``lengths`` in a signed integer dtype: unsigned ones wrap around on subtraction.

    Args:
        xp: the array namespace of ``lengths``.
        lengths: an integer array.

    Returns:
        ``lengths`` itself when its dtype is signed; else a copy in int32 (8 and 16
        bits) or int64 (32 and 64 bits).

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.signed(np, np.array([3, 5], dtype=np.uint8)).dtype
        dtype('int32')
        >>> masks.signed(np, np.array([3, 5], dtype=np.int16)).dtype
        dtype('int16')
    """
    if not xp.isdtype(lengths.dtype, "unsigned integer"):
        return lengths
    bits = xp.iinfo(lengths.dtype).bits
    return xp.astype(lengths, xp.int32 if bits <= 16 else xp.int64)


def jax_tracer_type() -> type | None:
    """JAX's tracer class, when JAX is imported; never imports JAX itself.

    Returns:
        ``jax.core.Tracer``, or None when JAX is not imported (``jax.core`` itself
        may not be in ``sys.modules``: recent JAX loads it lazily).

    Example:
        >>> import sys
        >>> from portattn import masks
        >>> masks.jax_tracer_type() is None or "jax" in sys.modules
        True
    """
    import sys

    jax = sys.modules.get("jax")
    core = getattr(jax, "core", None) if jax is not None else None
    return getattr(core, "Tracer", None)


def values_readable(a: Any) -> bool:
    """Whether ``a``'s values can be read now. Reading may still wait for a GPU.

    Args:
        a: an array of any library.

    Returns:
        False for a lazy Dask array, a JAX tracer, or a torch tensor while
        torch.compile traces; True otherwise.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.values_readable(np.arange(3))
        True
    """
    from array_api_compat import is_dask_array

    if is_dask_array(a):
        return False
    tracer = jax_tracer_type()
    if tracer is not None and isinstance(a, tracer):
        return False
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return not (tensor is not None and isinstance(a, tensor) and torch_compiling())


def torch_compiling() -> bool:
    """Whether torch.compile is tracing now; never imports torch.

    Returns:
        ``torch.compiler.is_compiling()``; False when torch is not imported, or is
        still being imported in another thread (its module then has no
        ``compiler`` yet).

    Example:
        >>> from portattn import masks
        >>> masks.torch_compiling()
        False
    """
    torch = sys.modules.get("torch")
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return is_compiling is not None and bool(is_compiling())


def host_copy(a: Any) -> Any:
    """``a`` as a NumPy array on the host, or None when its values cannot be read now
    (or NumPy is not installed: the block form is then the conservative one)."""
    if not values_readable(a):
        return None
    try:
        import numpy as np
        from array_api_compat import to_device

        try:
            return np.asarray(a)
        except (TypeError, RuntimeError, ValueError):
            return np.asarray(to_device(a, "cpu"))
    except Exception:  # e.g. no NumPy, or a library that cannot hand its values over
        return None


def check_range(xp: Any, lengths: Any, limit: int, kind: str) -> None:
    """Check that lengths lie in ``[0, limit]``, wherever the values are readable.

    Traced and lazy arrays are not checked: there a length out of range acts as if
    clipped to it.

    Args:
        xp: the array namespace of ``lengths``.
        lengths: an integer array.
        limit: the largest length allowed (``Lk`` or ``Lq``).
        kind: ``"key_lengths"`` (the limit is ``Lk``) or another kind's name (the
            limit is ``Lq``), for the error message.

    Raises:
        ValueError: a length lies outside ``[0, limit]``.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.check_range(np, np.array([3, 8]), 8, "key_lengths")
        >>> masks.check_range(np, np.array([3, 9]), 8, "key_lengths")
        Traceback (most recent call last):
        ...
        ValueError: key_lengths lengths must lie in [0, Lk=8]; got key_lengths with min=3, max=9
    """
    length_name = "Lk" if kind == "key_lengths" else "Lq"
    check_bounds(xp, lengths, limit, f"{kind} lengths", length_name, what=kind)


def check_bounds(xp: Any, a: Any, limit: int, name: str, limit_name: str,
                 what: str | None = None) -> None:
    """Values of ``a`` must lie in ``[0, limit]``, checked wherever they can be read."""
    if math.prod(a.shape) == 0 or not values_readable(a):
        return
    try:
        bad = bool(xp.any(xp.logical_or(a < 0, a > limit)))
    except Exception:  # values that exist only while tracing, under a transformation
        return           # not recognised above: they cannot be read, as documented
    if bad:
        low, high = int(xp.min(a)), int(xp.max(a))
        msg = (f"{name} must lie in [0, {limit_name}={limit}]; "
               f"got {what or name} with min={low}, max={high}")
        raise ValueError(msg)


def check_integer_array(xp: Any, a: Any, name: str, shape: tuple[int, ...]) -> Any:
    """``a`` checked to be integral with ``shape``; returned in a signed dtype."""
    if not xp.isdtype(a.dtype, "integral"):
        msg = f"{name} must have an integer dtype; got {name}.dtype={dtype_text(a.dtype)}"
        raise TypeError(msg)
    if tuple(a.shape) != tuple(shape):
        msg = f"{name} must have shape {tuple(shape)}; got {name}.shape={tuple(a.shape)}"
        raise ValueError(msg)
    return signed(xp, a)


def check_array(a: Any, kind: str, what: str, name: str | None = None) -> None:
    """A constructor's argument must be an array (checked before any binding)."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        got = type(a).__name__ if name is None else f"{name} of type {type(a).__name__}"
        msg = f"{kind} expects {what}; got {got}"
        raise TypeError(msg)


def dtype_text(dtype: Any) -> str:
    """A dtype's short name, for messages: ``float32`` whatever the library.

    Args:
        dtype: a dtype of any library.

    Returns:
        Its ``name`` when that is a string (NumPy, JAX), else the last dotted part
        of ``str(dtype)`` (``torch.float32`` gives ``float32``).

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> masks.dtype_text(np.dtype("uint8"))
        'uint8'
    """
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]
