"""Kernelised linear attention (Katharopoulos et al., 2020), O(L) in time and memory.

This is a different operator from softmax attention, not an approximation with an
error bound: the similarity ``exp(q . k / sqrt(D))`` is replaced by ``phi(q) . phi(k)``
for a positive feature map ``phi``, so that

    out_i = phi(q_i) @ (sum_j phi(k_j)^T v_j) / (phi(q_i) . sum_j phi(k_j))

and the sums over keys are computed once (or, causally, as running prefix sums) instead
of per query. Use it where a model was trained with it; it does not reproduce a
softmax-trained model. No log-sum-exp exists for it, and it takes no masks other than
``causal``.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from ._call import explain

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["elu_feature_map", "linear_attention"]


def elu_feature_map(x: Any) -> Any:
    """``elu(x) + 1``: ``x + 1`` for ``x > 0``, ``exp(x)`` otherwise; always positive.

    Args:
        x: any real floating array.

    Returns:
        An array of ``x``'s shape and dtype.

    Example:
        >>> import numpy as np
        >>> from portattn.linear import elu_feature_map
        >>> elu_feature_map(np.array([-1.0, 0.0, 2.0])).round(4).tolist()
        [0.3679, 1.0, 3.0]
    """
    from array_api_compat import array_namespace

    xp = array_namespace(x)
    # exp of the clipped value: the discarded branch must not overflow either.
    return xp.where(x > 0, x + 1, xp.exp(xp.minimum(x, xp.zeros_like(x))))


_FEATURE_MAPS: dict[str, Callable[[Any], Any]] = {"elu": elu_feature_map}


def linear_attention(query: Any, key: Any, value: Any, *, causal: bool = False,
                     feature_map: str | Callable[[Any], Any] = "elu",
                     chunk_size: int = 64) -> Any:
    """Linear attention ``phi(Q) (phi(K)^T V)``, normalised per query.

    Shapes as in :func:`portattn.attention`: ``query (..., Hq, Lq, D)``,
    ``key (..., Hkv, Lk, D)``, ``value (..., Hkv, Lk, Dv)``, ``Hq % Hkv == 0``; the
    output is ``(..., Hq, Lq, Dv)`` in the input dtype (half precision accumulates in
    float32). No ``1/sqrt(D)`` scale is applied: the feature map sees raw q and k.

    A query whose normaliser ``phi(q_i) . sum_j phi(k_j)`` is 0 (no keys) gets 0.

    Args:
        query: ``(..., Hq, Lq, D)``.
        key: ``(..., Hkv, Lk, D)``.
        value: ``(..., Hkv, Lk, Dv)``.
        causal: query ``i`` sees keys ``j <= i + (Lk - Lq)`` (bottom-right aligned, as
            :func:`portattn.masks.causal`); needs ``Lq <= Lk``. Computed in chunks of
            ``chunk_size`` queries: a prefix sum of per-chunk key/value states plus a
            small masked product inside each chunk, so time and memory stay O(L).
        feature_map: ``"elu"`` (``elu(x) + 1``) or a callable mapping an array
            ``(..., L, D)`` to positive features ``(..., L, F)``; it is applied to queries
            and keys alike, in float32 for half-precision inputs.
        chunk_size: queries per chunk for ``causal``; changes speed, not the result.

    Returns:
        ``(..., Hq, Lq, Dv)`` in ``query``'s dtype.

    Raises:
        ValueError: shapes do not fit together (as in :func:`portattn.attention`),
            ``causal`` with ``Lq > Lk``, an unknown ``feature_map`` name or one that
            returns the wrong shape, or ``chunk_size`` below 1.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> k = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> v = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> out = portattn.linear_attention(q, k, v, causal=True, chunk_size=3)
        >>> out.shape, out.dtype
        ((1, 2, 8, 4), dtype('float32'))

        The chunk size changes the schedule, not the result:

        >>> same = portattn.linear_attention(q, k, v, causal=True, chunk_size=8)
        >>> bool(np.allclose(out, same, atol=1e-5))
        True
    """
    # attention's own validation and description of (query, key, value), through the
    # public explain(); naming a kernel keeps overrides and measurements out of it.
    inputs = explain(query, key, value, kernel="reference").inputs
    phi = _resolve_feature_map(feature_map)
    chunk = _positive_int("chunk_size", chunk_size)
    if causal and inputs.q_len > inputs.kv_len:
        msg = (f"causal linear attention needs Lq <= Lk (bottom-right aligned); got "
               f"query.shape[-2]={inputs.q_len}, key.shape[-2]={inputs.kv_len}")
        raise ValueError(msg)
    if inputs.q_len == 0 or inputs.kv_len == 0:
        return _zeros(inputs)
    xp, ct = inputs.xp, inputs.compute_dtype
    q = _group_queries(xp, xp.astype(query, ct), inputs.num_kv_heads)
    k = xp.expand_dims(xp.astype(key, ct), axis=-3)      # (*b, Hkv, 1, Lk, D)
    v = xp.expand_dims(xp.astype(value, ct), axis=-3)
    fq, fk = phi(q), phi(k)
    if (fq.shape[-1] != fk.shape[-1] or fq.shape[:-1] != q.shape[:-1]
            or fk.shape[:-1] != k.shape[:-1]):
        msg = (f"feature_map must map (..., L, D) to (..., L, F) with one F; got "
               f"{tuple(q.shape)} -> {tuple(fq.shape)} and {tuple(k.shape)} -> "
               f"{tuple(fk.shape)}")
        raise ValueError(msg)
    if causal:
        num, den = _causal_sums(xp, fq, fk, v, chunk)
    else:
        num = xp.matmul(fq, xp.matmul(xp.matrix_transpose(fk), v))
        den = xp.sum(fq * xp.sum(fk, axis=-2, keepdims=True), axis=-1, keepdims=True)
    has_mass = den != 0
    out = num / xp.where(has_mass, den, xp.ones_like(den))
    *batch, hkv, group, lq, dv = out.shape
    return xp.astype(xp.reshape(out, (*batch, hkv * group, lq, dv)), query.dtype)


def _group_queries(xp: Any, x: Any, num_kv_heads: int) -> Any:
    """``(*b, Hq, L, D) -> (*b, Hkv, G, L, D)``: each K/V head broadcasts over its group
    of G query heads, never repeated."""
    *batch, hq, length, dim = x.shape
    return xp.reshape(x, (*batch, num_kv_heads, hq // num_kv_heads, length, dim))


def _zeros(inputs: Any) -> Any:
    """The output of a call without queries or keys: zeros ``(..., Hq, Lq, Dv)``."""
    shape = (*inputs.batch_shape, inputs.num_heads, inputs.q_len, inputs.value_head_dim)
    # Allocated with every axis at least 1, then sliced: Dask's automatic chunking
    # divides by zero on some zero-size shapes.
    full = inputs.xp.zeros(tuple(max(n, 1) for n in shape), dtype=inputs.query.dtype,
                           device=inputs.device_obj)
    return full[tuple(slice(0, n) for n in shape)]


def _causal_sums(xp: Any, fq: Any, fk: Any, v: Any, chunk: int) -> tuple[Any, Any]:
    """Numerators ``(..., Lq, Dv)`` and normalisers ``(..., Lq, 1)``, chunk by chunk.

    Keys before the first query's position form a shared prefix state; the last ``Lq``
    keys line up with the queries and are summed chunk by chunk: every chunk sees the
    states of the chunks before it (an exclusive prefix sum) plus its own keys through a
    lower-triangular ``chunk x chunk`` product.
    """
    lq, lk = fq.shape[-2], fk.shape[-2]
    prefix = lk - lq
    kv0 = z0 = None
    if prefix:
        kv0 = xp.matmul(xp.matrix_transpose(fk[..., :prefix, :]), v[..., :prefix, :])
        z0 = xp.sum(fk[..., :prefix, :], axis=-2, keepdims=True)
        fk, v = fk[..., prefix:, :], v[..., prefix:, :]
    c = min(chunk, lq)
    n = -(-lq // c)
    fq, fk, v = (_chunks(xp, a, n, c) for a in (fq, fk, v))   # (..., n, c, F|Dv)

    states = xp.matmul(xp.matrix_transpose(fk), v)            # (..., n, F, Dv)
    totals = xp.sum(fk, axis=-2, keepdims=True)               # (..., n, 1, F)
    seen_kv = _exclusive_cumsum(xp, states)
    seen_z = _exclusive_cumsum(xp, totals)
    if kv0 is not None:
        seen_kv = seen_kv + xp.expand_dims(kv0, axis=-3)
        seen_z = seen_z + xp.expand_dims(z0, axis=-3)

    rows = _arange(xp, c, fq)
    lower = xp.astype(rows[:, None] >= rows[None, :], fq.dtype)
    within = xp.matmul(fq, xp.matrix_transpose(fk)) * lower  # (..., n, c, c)
    num = xp.matmul(within, v) + xp.matmul(fq, seen_kv)
    den = (xp.sum(within, axis=-1, keepdims=True)
           + xp.sum(fq * seen_z, axis=-1, keepdims=True))
    return _unchunk(xp, num, lq), _unchunk(xp, den, lq)


def _arange(xp: Any, n: int, like: Any) -> Any:
    """``arange(n)`` on ``like``'s device; a traced array (jit) has none to name."""
    from array_api_compat import device

    try:
        dev = device(like)
    except Exception:
        dev = None
    return xp.arange(n) if dev is None else xp.arange(n, device=dev)


def _chunks(xp: Any, a: Any, n: int, c: int) -> Any:
    """``(..., L, F) -> (..., n, c, F)``, zero-padded at the end (zeros add nothing)."""
    from array_api_extra import pad

    length = a.shape[-2]
    if n * c != length:
        widths = [(0, 0)] * (a.ndim - 2) + [(0, n * c - length), (0, 0)]
        a = pad(a, widths, xp=xp)
    return xp.reshape(a, (*a.shape[:-2], n, c, a.shape[-1]))


def _unchunk(xp: Any, a: Any, length: int) -> Any:
    *lead, n, c, f = a.shape
    return xp.reshape(a, (*lead, n * c, f))[..., :length, :]


def _exclusive_cumsum(xp: Any, a: Any) -> Any:
    """Sum over the chunks before each one (axis -3), without subtracting: exact zeros."""
    shifted = xp.concat([xp.zeros_like(a[..., :1, :, :]), a[..., :-1, :, :]], axis=-3)
    return xp.cumulative_sum(shifted, axis=a.ndim - 3)


def _resolve_feature_map(feature_map: Any) -> Callable[[Any], Any]:
    if callable(feature_map):
        return feature_map
    if isinstance(feature_map, str) and feature_map in _FEATURE_MAPS:
        return _FEATURE_MAPS[feature_map]
    msg = (f"feature_map must be one of {sorted(_FEATURE_MAPS)} or a callable; got "
           f"feature_map={feature_map!r}")
    raise ValueError(msg)


def _positive_int(name: str, value: Any) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = 0
    if isinstance(value, bool) or number < 1:
        msg = f"{name} must be an int >= 1; got {name}={value!r}"
        raise ValueError(msg)
    return number
