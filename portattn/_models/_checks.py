"""Argument checks for the model-level modules: one library, device and dtype, weight
shapes that fit together, sizes, and the integer arrays a call reads on the host.
Each error names the argument and its value."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, NamedTuple

from array_api_compat import array_namespace

from .._lib import check_like, dtype_name, host_values, safe_device

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Dims", "check_features", "check_same", "count", "dimensions", "host_ints",
           "int_at_least", "integer_array", "namespace_of"]

WEIGHTS = ("w_q", "w_k", "w_v", "w_o")
BIASES = ("b_q", "b_k", "b_v", "b_o")


class Dims(NamedTuple):
    d_model: int
    d_context: int
    head_dim: int
    value_head_dim: int
    num_kv_heads: int
    d_value_context: int
    """Feature size of the values' input (torch's ``vdim``): ``d_context`` unless values
    come from an input of their own."""


def namespace_of(x: Any, name: str, min_ndim: int) -> tuple[Any, Any]:
    """``(xp, device)`` of a real floating array with at least ``min_ndim`` dims."""
    try:
        xp = array_namespace(x)
    except TypeError as e:
        msg = f"{name} must be an array; got {type(x).__module__}.{type(x).__name__}"
        raise TypeError(msg) from e
    if x.ndim < min_ndim or not xp.isdtype(x.dtype, "real floating"):
        msg = (f"{name} must be a real floating array with at least {min_ndim} dims; got "
               f"{name}.shape={tuple(x.shape)}, {name}.dtype={dtype_name(x.dtype)}")
        raise ValueError(msg)
    return xp, safe_device(x)


def check_same(xp: Any, dev: Any, anchor: Any, a: Any, name: str, anchor_name: str) -> None:
    """``a`` has ``anchor``'s library, device and dtype."""
    check_like(xp, dev, a, name, anchor_name)
    if a.dtype != anchor.dtype:
        msg = (f"{name}.dtype={dtype_name(a.dtype)} differs from "
               f"{anchor_name}.dtype={dtype_name(anchor.dtype)}")
        raise TypeError(msg)


def check_features(name: str, a: Any, expected: int, source: str) -> None:
    if a.ndim < 2 or a.shape[-1] != expected:
        msg = (f"{name} must have shape (..., length, {expected}) to match {source}; "
               f"got {name}.shape={tuple(a.shape)}")
        raise ValueError(msg)


def int_at_least(name: str, value: Any, low: int = 0) -> int:
    """``value`` as an int (anything ``operator.index`` takes, not a bool) of at least
    ``low``."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < low:
        msg = f"{name} must be an int >= {low}; got {name}={value!r}"
        raise ValueError(msg)
    return number


def integer_array(xp: Any, dev: Any, a: Any, name: str, ndim: int, anchor: str) -> Any:
    """``a``, checked to be an integer array of ``ndim`` dims beside ``anchor``."""
    if (not hasattr(a, "shape") or len(a.shape) != ndim
            or not xp.isdtype(a.dtype, "integral")):
        msg = (f"{name} must be an integer array with {ndim} dims; got {name} of type "
               f"{type(a).__name__} with shape {tuple(getattr(a, 'shape', ()))}")
        raise ValueError(msg)
    check_like(xp, dev, a, name, anchor)
    return a


def host_ints(xp: Any, dev: Any, a: Any, name: str, shape: tuple[int, ...] | None,
              anchor: str) -> list[int]:
    """The values of an integer array of ``shape`` (any 1-D one when None), read on the
    host (lengths and tables that plan a call there)."""
    a = integer_array(xp, dev, a, name, 1 if shape is None else len(shape), anchor)
    if shape is not None and tuple(a.shape) != shape:
        msg = f"{name} must have shape {shape}; got {name}.shape={tuple(a.shape)}"
        raise ValueError(msg)
    host = host_values(a)
    if host is None:
        msg = (f"{name} must hold values that can be read now (the call is planned on "
               f"the host); got a traced {type(a).__name__} (under jax.jit or "
               f"torch.compile)")
        raise ValueError(msg)
    return [int(x) for x in host.reshape(-1)]


def count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be an int >= 1; got {name}={value!r}"
        raise ValueError(msg)
    return value


def dimensions(w_q: Any, w_k: Any, w_v: Any, w_o: Any, num_heads: int,
              num_kv_heads: int | None, biases: Mapping[str, Any]) -> Dims:
    """Check the weight and bias shapes against each other and the head counts."""
    heads = count("num_heads", num_heads)
    kv_heads = heads if num_kv_heads is None else count("num_kv_heads", num_kv_heads)
    if heads % kv_heads:
        msg = (f"num_heads must be a multiple of num_kv_heads; got num_heads={heads}, "
               f"num_kv_heads={kv_heads}")
        raise ValueError(msg)
    for name, w in zip(WEIGHTS, (w_q, w_k, w_v, w_o), strict=True):
        if not hasattr(w, "shape") or len(w.shape) != 2:
            shape = getattr(w, "shape", type(w).__name__)
            msg = f"{name} must be a 2-d array (in_features, out_features); got {shape}"
            raise ValueError(msg)
    d_model, q_size = w_q.shape
    if q_size % heads:
        msg = (f"w_q.shape[1]={q_size} (num_heads * head_dim) is not divisible by "
               f"num_heads={heads}")
        raise ValueError(msg)
    head_dim = q_size // heads
    d_context = w_k.shape[0]
    if tuple(w_k.shape) != (d_context, kv_heads * head_dim):
        msg = (f"w_k must have shape (d_context, num_kv_heads * head_dim) = "
               f"({d_context}, {kv_heads * head_dim}); got w_k.shape={tuple(w_k.shape)}")
        raise ValueError(msg)
    if w_v.shape[1] % kv_heads:
        msg = (f"w_v must have shape (d_value_context, num_kv_heads={kv_heads} * "
               f"value_head_dim); got w_v.shape={tuple(w_v.shape)}")
        raise ValueError(msg)
    value_dim = w_v.shape[1] // kv_heads
    if w_o.shape[0] != heads * value_dim:
        msg = (f"w_o must have shape (num_heads * value_head_dim = {heads * value_dim}, "
               f"d_out); got w_o.shape={tuple(w_o.shape)}")
        raise ValueError(msg)
    sizes = {"b_q": q_size, "b_k": w_k.shape[1], "b_v": w_v.shape[1], "b_o": w_o.shape[1]}
    for name, b in biases.items():
        if b is not None and tuple(b.shape) != (sizes[name],):
            msg = f"{name} must have shape ({sizes[name]},); got {name}.shape={tuple(b.shape)}"
            raise ValueError(msg)
    return Dims(d_model, d_context, head_dim, value_dim, kv_heads, w_v.shape[0])
