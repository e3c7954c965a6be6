"""One attention call, validated and described.

:func:`describe` checks the arguments once (clear ``TypeError``/``ValueError`` naming
the argument and its value) and returns a frozen :class:`AttentionInputs` that every
kernel receives. It also renders the "inputs block" shown in errors and logs.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

from array_api_compat import array_namespace
from array_api_compat import device as device_of

from .. import masks as _masks
from .. import scores as _scores
from .._lib import (
    check_beside,
    check_seed,
    device_kind,
    dtype_name,
    in_native_order,
    is_native,
    namespace_name,
    needs_grad,
    values_readable,
)
from ._layout import check_layout, shown

if TYPE_CHECKING:
    from ..masks import BlockMask, Mask

__all__ = ["AttentionInputs", "describe"]

_HALF = ("float16", "bfloat16")


class AttentionInputs(NamedTuple):
    """Everything a kernel needs to know about one call, validated and immutable.

    Dispatch builds one per call and hands it to
    :meth:`~portattn.kernel.Kernel.not_supported_reasons` and
    :meth:`~portattn.kernel.Kernel.run`; ``portattn.explain(...).inputs`` shows it.

    - ``query``, ``key``, ``value``: the arrays in the kernels' layout,
      ``(*batch, H, L, D)``, whatever ``layout`` the caller used;
    - ``mask``: the mask bound to the call (a boolean array arrives as ``dense``),
      or None; ``bias``: broadcastable to ``(*batch, Hq, Lq, Lk)`` with full rank,
      or None;
    - ``scale`` (the default ``1/sqrt(D)`` filled in), ``softcap``, ``dropout_p``,
      ``return_lse``, ``return_weights``: the options of :func:`portattn.attention`;
    - ``xp``, ``namespace``, ``device``, ``device_obj``, ``dtype``: the array
      namespace, the library's short name (``"numpy"``), the device kind (``"cpu"``,
      ``"cuda"``), the device object (None when unknown) and the dtype's name;
    - ``batch_shape``, ``num_heads``, ``num_kv_heads``, ``q_len``, ``kv_len``,
      ``head_dim``, ``value_head_dim``: the sizes;
    - ``requires_grad``: autograd wants gradients through the call;
      ``mask_kinds``: the mask's :attr:`~portattn.masks.Mask.kinds`.

    A named tuple rather than a frozen dataclass: it is built on every call, and
    dispatch overhead matters for short sequences.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> q = np.zeros((1, 4, 8, 4), dtype=np.float32)
        >>> kv = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> inputs = portattn.explain(q, kv, kv, mask=masks.causal(), kernel="tiled").inputs
        >>> inputs.batch_shape, inputs.num_heads, inputs.num_kv_heads, inputs.group_size
        ((1,), 4, 2, 2)
        >>> inputs.namespace, inputs.device, inputs.dtype, inputs.scale
        ('numpy', 'cpu', 'float32', 0.5)
        >>> sorted(inputs.mask_kinds)
        ['causal']
        >>> inputs.blocks(4, 4).merged.tolist()  # 0 hidden, 1 partial, 2 full
        [[1, 0], [2, 1]]
    """

    query: Any
    key: Any
    value: Any
    mask: Mask | None
    bias: Any
    scale: float
    softcap: float | None
    return_lse: bool
    return_weights: bool
    dropout_p: float
    xp: Any
    namespace: str
    device: str
    device_obj: Any
    dtype: str
    batch_shape: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_head_dim: int
    requires_grad: bool
    mask_kinds: frozenset[str] = frozenset()
    alibi_slopes: Any = None
    """``(*batch | 1, Hq)``: ``-slope * |i + Lk - Lq - j|`` joins the scores."""
    sinks: Any = None
    """``(*batch | 1, Hq)``: a logit per head in each row's softmax denominator."""
    assume_finite: bool = False
    """The caller's word that no input holds NaN or inf: kernels may skip what keeps
    the rule for non-finite inputs."""
    dropout_seed: Any = None
    """With ``dropout_p > 0``: an int or an integer array (see
    :mod:`portattn.dropout`), or None to draw one from the library's generator."""
    score_mod: Any = None
    """A :class:`portattn.scores.ScoreChange` bound to the call, or None: its entries
    join the scores (after softcap, beside the bias)."""
    return_max_scores: bool = False
    """The caller asks for each row's largest score; dispatch computes it in a pass of
    its own, whichever kernel runs the call."""

    @property
    def compute_dtype(self) -> Any:
        """float32 for half precision inputs, the input dtype otherwise."""
        return self.xp.float32 if self.dtype in _HALF else self.query.dtype

    @property
    def group_size(self) -> int:
        """Query heads per key/value head, ``num_heads // num_kv_heads``."""
        return self.num_heads // self.num_kv_heads

    @property
    def values_readable(self) -> bool:
        """Whether the call's values can be read on the host now: CPU arrays, neither
        traced (``jax.jit``, ``torch.compile``) nor lazy (Dask). Only then does dispatch
        check the output of a kernel that declares ``finite_inputs_only``: on an
        accelerator each read would stall the caller's stream (a host sync per call)."""
        return self.device == "cpu" and values_readable(self.query)

    def blocks(self, block_q: int, block_k: int) -> BlockMask:
        """The mask's block form on a grid of ``block_q x block_k`` tiles (every tile
        full without a mask), built once per call and grid: which tiles a kernel skips,
        which it computes without a mask and which with ``mask.tile``."""
        return _masks.block_mask(self.mask, self.q_len, self.kv_len, block_q, block_k)

    def block(self) -> str:
        """The inputs block used in errors and logs."""
        dev = self.device if self.device_obj is None or self.device == "cpu" else self.device_obj
        lines = []
        for name in ("query", "key", "value"):
            a = getattr(self, name)
            lines.append(f"    {name:<6}: shape={tuple(a.shape)} dtype={self.dtype} "
                         f"namespace={self.namespace} device={dev}")
        bias = None if self.bias is None else f"shape={tuple(self.bias.shape)}"
        lines.append(f"    mask={self.mask!r} bias={bias} scale={self.scale:.6g} "
                     f"softcap={self.softcap}")
        for name in ("alibi_slopes", "sinks"):
            if getattr(self, name) is not None:
                lines.append(f"    {name}: shape={tuple(getattr(self, name).shape)}")
        if self.score_mod is not None:
            lines.append(f"    score_mod={self.score_mod!r}")
        flags = [f for f in ("return_lse", "return_weights", "return_max_scores",
                             "requires_grad") if getattr(self, f)]
        if self.dropout_p:
            flags.append(f"dropout_p={self.dropout_p}")
        if flags:
            lines.append("    " + " ".join(flags))
        return "\n".join(lines)


def describe(query: Any, key: Any, value: Any, *, mask: Mask | None = None, bias: Any = None,
             scale: float | None = None, softcap: float | None = None,
             return_lse: bool = False, return_weights: bool = False,
             dropout_p: float = 0.0, alibi_slopes: Any = None,
             sinks: Any = None, layout: str = "bhld",
             assume_finite: bool = False, dropout_seed: Any = None,
             score_mod: Any = None, return_max_scores: bool = False) -> AttentionInputs:
    """Validate one call's arguments and describe it: the :class:`AttentionInputs` a
    kernel's ``run`` and ``not_supported_reasons`` receive (what
    :func:`portattn.attention` builds before dispatch), for testing a kernel directly.

    Args:
        query, key, value: The arrays, in the kernels' layout ``(*batch, H, L, D)``.
        mask, bias, scale, softcap, return_lse, return_weights, dropout_p,
            dropout_seed, alibi_slopes, sinks, assume_finite, score_mod,
            return_max_scores: As for
            :func:`portattn.attention`.
        layout: The caller's layout, named in error messages only.

    Returns:
        The call's :class:`AttentionInputs`.

    Raises:
        ValueError, TypeError: Arguments :func:`portattn.attention` would refuse.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> from portattn.kernel import describe
        >>> q = np.zeros((1, 4, 8, 16), np.float32)
        >>> kv = np.zeros((1, 2, 8, 16), np.float32)
        >>> inputs = describe(q, kv, kv, mask=masks.causal())
        >>> inputs.num_heads, inputs.num_kv_heads, inputs.q_len, inputs.dtype
        (4, 2, 8, 'float32')
    """
    arrays = {"query": query, "key": key, "value": value}
    xp = _common_namespace(arrays)
    dev = _common_device(arrays)
    if not all(is_native(a) for a in arrays.values()):
        arrays = {n: in_native_order(xp, a) for n, a in arrays.items()}
        query, key, value = arrays.values()
    _check_dtypes(xp, arrays)
    batch, hq, hkv, lq, lk, d, dv = _check_shapes(query, key, value, check_layout(layout))
    full_shape = (*batch, hq, lq, lk)

    if mask is not None:
        if not isinstance(mask, _masks.Mask):
            if hasattr(mask, "shape"):
                mask = _masks.dense(mask)
            else:
                msg = f"mask must be a portattn.masks mask or a boolean array; got {mask!r}"
                raise TypeError(msg)
        mask = mask.bind(xp, batch, hq, lq, lk, dev)  # the call's own copy
    if bias is not None:
        check_beside(xp, dev, bias, "bias")
        bias = in_native_order(xp, bias)
        _check_floating(xp, bias, "bias")
        bias = _masks.expand_to_rank(xp, bias, full_shape, "bias")
    if alibi_slopes is not None:
        if getattr(alibi_slopes, "requires_grad", False) is True:
            msg = ("alibi_slopes are constants (no gradient flows to them, as in "
                   "flash-attn); pass alibi_slopes.detach(), or learn them with "
                   "score_mod=portattn.scores.alibi(slopes)")
            raise ValueError(msg)
        alibi_slopes = _per_head(xp, dev, alibi_slopes, "alibi_slopes", batch, hq)
    if sinks is not None:
        sinks = _per_head(xp, dev, sinks, "sinks", batch, hq)
    if score_mod is not None:
        if not isinstance(score_mod, _scores.ScoreChange):
            msg = ("score_mod must be a portattn.scores change (scores.relative_position, "
                   f"scores.pair_table, ...); got {type(score_mod).__name__}")
            raise TypeError(msg)
        score_mod = score_mod.bind(xp, dev, batch, hq, lq, lk)

    scale = _check_scale(scale, default=1.0 / math.sqrt(d) if d else 1.0)
    if softcap is not None:
        softcap = _check_positive("softcap", softcap)
    dropout_p = _check_dropout_p(xp, dropout_p)
    namespace = namespace_name(xp)
    dropout_seed = _check_dropout_seed(xp, dev, dropout_seed, namespace, dropout_p)

    return AttentionInputs(
        query=query, key=key, value=value, mask=mask, bias=bias, scale=scale,
        softcap=softcap, return_lse=_check_flag("return_lse", return_lse),
        return_weights=_check_flag("return_weights", return_weights),
        dropout_p=dropout_p, xp=xp, namespace=namespace,
        device="cpu" if dev is None else device_kind(dev), device_obj=dev,
        dtype=dtype_name(query.dtype),
        batch_shape=batch, num_heads=hq, num_kv_heads=hkv, q_len=lq, kv_len=lk,
        head_dim=d, value_head_dim=dv,
        requires_grad=needs_grad((query, key, value, bias, sinks, *_trained(score_mod))),
        mask_kinds=mask.kinds if mask is not None else frozenset(),
        alibi_slopes=alibi_slopes, sinks=sinks,
        assume_finite=_check_flag("assume_finite", assume_finite),
        dropout_seed=dropout_seed, score_mod=score_mod,
        return_max_scores=_check_flag("return_max_scores", return_max_scores),
    )


def _trained(score_mod: Any) -> tuple[Any, ...]:
    """The arrays of a score change that get gradients."""
    if score_mod is None:
        return ()
    return tuple(a for a, t in zip(score_mod.arrays, score_mod.trainable, strict=True) if t)


def _check_dropout_p(xp: Any, value: Any) -> float:
    """``dropout_p`` as a float in ``[0, 1)``: a real number (Python's, NumPy's of any
    width, or a 0-d array of the query's library whose value can be read now)."""
    number = _probability(xp, value)
    if not 0.0 <= number < 1.0:  # NaN too
        msg = f"dropout_p must be a float in [0, 1); got dropout_p={value!r}"
        raise ValueError(msg)
    return number


def _probability(xp: Any, value: Any) -> float:
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        msg = ("dropout_p must be a float in [0, 1), a real number, not a bool; got "
               f"dropout_p={value}")
        raise ValueError(msg)
    if isinstance(value, (int, float)) or _numpy_scalar(value, "integer", "floating"):
        return float(value)
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        msg = (f"dropout_p must be a float in [0, 1) (a Python or NumPy number, or a 0-d "
               f"array of the query's library); got dropout_p={value!r} "
               f"({type(value).__name__})")
        raise ValueError(msg)
    if tuple(value.shape) != ():
        msg = (f"dropout_p must be a float in [0, 1), a number or a 0-d array; got "
               f"dropout_p of shape {tuple(value.shape)}")
        raise ValueError(msg)
    library = _library_of(value)
    if library != namespace_name(xp):
        msg = (f"dropout_p must be a float in [0, 1); a 0-d array must come from the "
               f"query's library ({namespace_name(xp)}); got dropout_p from {library}")
        raise ValueError(msg)
    if not xp.isdtype(value.dtype, ("integral", "real floating")):
        msg = (f"dropout_p must be a float in [0, 1), a real number; got dropout_p of "
               f"dtype {dtype_name(value.dtype)}")
        raise ValueError(msg)
    if not values_readable(value):
        msg = (f"dropout_p must be a float in [0, 1) readable now; got dropout_p of type "
               f"{type(value).__name__}, lazy or traced (pass a Python number)")
        raise ValueError(msg)
    return float(value)


def _library_of(a: Any) -> str:
    try:
        return namespace_name(array_namespace(a))
    except TypeError:
        return type(a).__module__.split(".")[0]


def _check_dropout_seed(xp: Any, dev: Any, seed: Any, namespace: str,
                        dropout_p: float) -> Any:
    """The seed the call's kernels read (None without dropout). A seed given is checked
    with or without dropout, so a bad one fails alike; NumPy integer scalars are the
    ints they hold, whatever the call's library."""
    if seed is None and not dropout_p:
        return None
    if _numpy_scalar(seed, "integer"):
        seed = int(seed)
    elif seed is not None and not isinstance(seed, int):
        if _numpy_scalar(seed, "generic") or not hasattr(seed, "dtype"):
            msg = f"dropout_seed must be an int or an integer array; got {seed!r}"
            raise TypeError(msg)
        check_beside(xp, dev, seed, "dropout_seed")
    seed = check_seed(xp, seed, namespace)  # bools refused there
    return seed if dropout_p else None  # nothing is dropped


def _numpy_scalar(value: Any, *kinds: str) -> bool:
    """Whether ``value`` is a NumPy scalar of one of these abstract kinds
    (``"integer"``, ``"floating"``, ``"generic"``); never imports NumPy."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, tuple(getattr(numpy, k) for k in kinds))


def _per_head(xp: Any, dev: Any, a: Any, name: str, batch: tuple[int, ...], heads: int) -> Any:
    """A float value per query head, ``(Hq,)`` or ``(*batch, Hq)``, as ``(*batch | 1, Hq)``."""
    check_beside(xp, dev, a, name)
    _check_floating(xp, a, name)
    shape = tuple(a.shape)
    if shape not in ((heads,), (*batch, heads)):
        msg = (f"{name} must have shape (Hq,) = ({heads},) or (*batch, Hq) = "
               f"{(*batch, heads)}; got {name}.shape={shape}")
        raise ValueError(msg)
    return xp.reshape(a, (*(1,) * (len(batch) + 1 - len(shape)), *shape))


_namespaces: dict[tuple[type, ...], Any] = {}


def _common_namespace(arrays: dict[str, Any]) -> Any:
    # The namespace follows from the array types; remember it (dispatch runs per call).
    types = tuple(type(a) for a in arrays.values())
    xp = _namespaces.get(types)
    if xp is not None:
        return xp
    for name, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            msg = f"{name} must be an array; got {type(a).__name__}"
            raise TypeError(msg)
    try:
        xp = _namespaces[types] = array_namespace(*arrays.values())
        return xp
    except TypeError as e:
        kinds = ", ".join(f"{n}={type(a).__module__}.{type(a).__name__}"
                          for n, a in arrays.items())
        msg = f"query, key and value must come from one array library; got {kinds}"
        raise TypeError(msg) from e


def _device(a: Any) -> Any:
    try:
        return device_of(a)
    except Exception:  # e.g. a tracer that carries no device while being traced
        return None


def _same_device(a: Any, query: Any) -> bool:
    """Cheap check through the standard ``.device`` attribute; False when unsure."""
    if a is query:
        return True
    try:
        return type(a) is type(query) and bool(a.device == query.device)
    except Exception:  # no .device attribute (dask), or a tracer
        return False


def _common_device(arrays: dict[str, Any]) -> Any:
    query, key, value = arrays.values()
    if _same_device(key, query) and _same_device(value, query):
        return _device(query)  # the common case: one device lookup instead of three
    # A traced array has no device, and a traced function may close over concrete
    # arrays (jax.grad of the query alone): compare only the devices that are known.
    devices = {n: _device(a) for n, a in arrays.items()}
    known = [d for d in devices.values() if d is not None]
    if any(d != known[0] for d in known[1:]):
        listed = ", ".join(f"{n}.device={d}" for n, d in devices.items())
        msg = f"query, key and value must be on one device; got {listed}"
        raise ValueError(msg)
    return known[0] if known else None  # None: ``device=None`` works in every library


_floating: dict[tuple[Any, type, Any], bool | None] = {}
_UNASKED = object()


def _is_floating(xp: Any, dtype: Any) -> bool | None:
    """Whether ``dtype`` is a real floating dtype of ``xp``; None when ``xp.isdtype``
    does not know it (NumPy and CuPy hold bfloat16 and the float8 types as ml_dtypes'
    types, which their ``isdtype`` refuses)."""
    # by library too: JAX's bfloat16 and NumPy's are one dtype object, and only JAX knows it
    key = (getattr(xp, "__name__", type(xp)), type(dtype), dtype)
    result = _floating.get(key, _UNASKED)
    if result is _UNASKED:
        try:
            result = bool(xp.isdtype(dtype, "real floating"))
        except TypeError:
            result = None
        _floating[key] = result
    return result


def _check_floating(xp: Any, a: Any, name: str) -> None:
    """``a`` (the argument ``name``) must have a real floating dtype that ``xp`` knows."""
    floating = _is_floating(xp, a.dtype)
    if floating:
        return
    got = f"{name}.dtype={dtype_name(a.dtype)}"
    if floating is None:
        library = namespace_name(xp)
        msg = (f"{name} must have a real floating dtype of {library}'s array API; got "
               f"{got}, which {library}.isdtype does not know: cast {name} to float16 or "
               "float32 (torch and JAX arrays take bfloat16)")
    else:
        msg = f"{name} must have a real floating dtype; got {got}"
    raise TypeError(msg)


def _check_dtypes(xp: Any, arrays: dict[str, Any]) -> None:
    query, key, value = arrays.values()
    if query.dtype == key.dtype == value.dtype and _is_floating(xp, query.dtype):
        return
    for n, a in arrays.items():
        _check_floating(xp, a, n)
    names = {n: dtype_name(a.dtype) for n, a in arrays.items()}
    if len(set(names.values())) > 1:
        listed = ", ".join(f"{n}.dtype={d}" for n, d in names.items())
        msg = f"query, key and value must share one dtype; got {listed}"
        raise TypeError(msg)


def _check_shapes(query: Any, key: Any, value: Any, layout: str = "bhld") -> tuple:
    """The call's sizes from ``(..., heads, length, dim)`` shapes; errors speak of the
    shapes and axes as the caller laid them out."""
    q, k, v = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if _shapes_fit(q, k, v):
        return q[:-3], q[-3], k[-3], q[-2], k[-2], q[-1], v[-1]
    # Something is off: find it and say what.
    heads = -3 if layout == "bhld" else -2
    axes = "(..., heads, length, head_dim)" if layout == "bhld" else (
        "(..., length, heads, head_dim)")
    q_, k_, v_ = (shown(s, layout) for s in (q, k, v))
    for name, shape in (("query", q_), ("key", k_), ("value", v_)):
        if len(shape) < 3:
            msg = f"{name} must have shape {axes} with at least 3 dims; got {name}.shape={shape}"
            raise ValueError(msg)
    if not len(q) == len(k) == len(v):
        msg = f"query, key and value must have the same rank; got shapes {q_}, {k_}, {v_}"
        raise ValueError(msg)
    if not q[:-3] == k[:-3] == v[:-3]:
        msg = (f"query, key and value must share the leading batch dims; got "
               f"query.shape={q_}, key.shape={k_}, value.shape={v_}")
        raise ValueError(msg)
    if q[-1] != k[-1]:
        msg = (f"query and key must have the same head dimension; got "
               f"query.shape[-1]={q[-1]}, key.shape[-1]={k[-1]}")
        raise ValueError(msg)
    # Arrays laid out the other way often fail only here: say so.
    hint = ("; for (..., length, heads, head_dim) arrays pass layout='blhd'"
            if layout == "bhld" and _shapes_fit(*(shown(s, "blhd") for s in (q, k, v))) else "")
    if k[-3:-1] != v[-3:-1]:
        msg = (f"key and value must have the same heads and length; got "
               f"key.shape={k_}, value.shape={v_}{hint}")
        raise ValueError(msg)
    msg = (f"query heads must be a multiple of key/value heads (grouped-query); got "
           f"query.shape[{heads}]={q[-3]}, key.shape[{heads}]={k[-3]}{hint}")
    raise ValueError(msg)


def _shapes_fit(q: tuple, k: tuple, v: tuple) -> bool:
    return (len(q) >= 3 and len(q) == len(k) == len(v) and q[:-3] == k[:-3] == v[:-3]
            and q[-1] == k[-1] and k[-3:-1] == v[-3:-1] and k[-3] > 0 and not q[-3] % k[-3])


def _check_scale(value: Any, default: float) -> float:
    """Any finite real number (0 averages the values, a negative one reverses the
    ranking, as in torch); None is ``default``."""
    if value is None:
        return default
    number = _real(value)
    if number is None or not math.isfinite(number):
        msg = f"scale must be a finite real number; got scale={value!r}"
        raise ValueError(msg)
    return number


def _check_positive(name: str, value: Any) -> float:
    number = _real(value)
    if number is None or not math.isfinite(number) or number <= 0:
        msg = f"{name} must be a finite number > 0; got {name}={value!r}"
        raise ValueError(msg)
    return number


def _real(value: Any) -> float | None:
    """``value`` as a float when it is a real number (not a bool, not a string)."""
    if isinstance(value, (bool, str, bytes)) or type(value).__name__ == "bool_":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _check_flag(name: str, value: Any) -> bool:
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    msg = f"{name} must be True or False; got {name}={value!r}"
    raise ValueError(msg)
