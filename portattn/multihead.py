"""Multi-head attention: projections, heads, output projection, on any library.

:func:`multi_head_attention` is the functional form; :class:`MultiHeadAttention` holds
the weights. Weights apply as ``x @ W`` (``W`` is ``(in_features, out_features)``, the
transpose of a torch ``nn.Linear.weight``). Grouped-query attention (``num_kv_heads <
num_heads``, multi-query when 1) projects fewer key/value heads and lets the attention
kernel share each across its group; nothing is repeated per head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._call import attention
from ._lib import dtype_name, namespace, place, resolve_dtype, safe_device
from ._models import (
    BIASES,
    WEIGHTS,
    check_features,
    check_same,
    count,
    dimensions,
    namespace_of,
)
from .paged import check_mask
from .paged_cache import PagedStep

if TYPE_CHECKING:

    from .kv_cache import KVCache
    from .masks import Mask
    from .paged_cache import PagedKVCache

__all__ = ["MultiHeadAttention", "multi_head_attention"]

def multi_head_attention(x: Any, w_q: Any, w_k: Any, w_v: Any, w_o: Any, *, num_heads: int,
                         num_kv_heads: int | None = None, b_q: Any = None, b_k: Any = None,
                         b_v: Any = None, b_o: Any = None, context: Any = None,
                         value_context: Any = None, mask: Mask | Any = None,
                         bias: Any = None, scale: float | None = None,
                         kernel: str | None = None,
                         cache: KVCache | PagedStep | None = None) -> Any:
    """Multi-head (grouped-query, multi-query, cross) attention of ``x``.

    Shapes: ``x (..., L, d_model)``; ``w_q (d_model, num_heads * head_dim)``;
    ``w_k (d_context, num_kv_heads * head_dim)``; ``w_v (d_context, num_kv_heads * dv)``;
    ``w_o (num_heads * dv, d_out)``; biases are 1-d with the projections' output size.
    ``d_context`` is ``d_model`` for self-attention. The result is ``(..., L, d_out)``.
    With ``value_context``, ``w_v`` is ``(d_value_context, num_kv_heads * dv)``.

    Args:
        x: ``(..., L, d_model)``, the queries' input (and the keys' and values' for
            self-attention).
        w_q: ``(d_model, num_heads * head_dim)``.
        w_k: ``(d_context, num_kv_heads * head_dim)``.
        w_v: ``(d_context, num_kv_heads * dv)``.
        w_o: ``(num_heads * dv, d_out)``.
        num_heads: query heads; ``w_q.shape[1]`` must be divisible by it.
        num_kv_heads: key/value heads (default ``num_heads``); must divide ``num_heads``.
        b_q: optional bias of the query projection, ``(num_heads * head_dim,)``.
        b_k: optional bias of the key projection.
        b_v: optional bias of the value projection.
        b_o: optional bias of the output projection, ``(d_out,)``.
        context: ``(..., S, d_context)``; keys and values come from it instead of ``x``
            (cross-attention). Same library, device and dtype as ``x``.
        value_context: ``(..., S, d_value_context)``; values come from it instead of
            ``context``, whose feature size may differ (torch's ``kdim``/``vdim``).
        mask: a :mod:`portattn.masks` mask or a boolean array (True = attend), over
            ``(..., num_heads, L, S)``; e.g. ``masks.causal()`` for a decoder or
            ``masks.key_lengths(lengths)`` for padded keys. A float array is added to
            the scores instead (torch's float ``attn_mask``), like ``bias``.
        bias: a float array added to the scores, broadcastable to
            ``(..., num_heads, L, S)`` (``-inf`` hides a pair).
        scale: score scale, default ``1/sqrt(head_dim)``.
        kernel: force an attention kernel by name.
        cache: a :class:`portattn.KVCache`; the new keys and values are appended to it
            and the queries attend to everything cached (self-attention only). With
            ``masks.causal()`` (bottom-right aligned) a step over new tokens equals the
            matching rows of a causal pass over the whole sequence. A ragged cache
            (:meth:`KVCache.ragged`) takes ``mask=None`` and applies its own mask.
            Or a :class:`portattn.PagedStep` (:meth:`PagedKVCache.step`): ``x`` is
            ``(T, d_model)``, the packed new tokens of several sequences, each
            attending its own cached keys (:func:`portattn.paged_attention`; ``mask``
            one that reads positions alone, no ``bias`` or ``kernel``).

    Returns:
        ``(..., L, d_out)``, in ``x``'s library and dtype.

    Raises:
        ValueError: shapes, head counts or feature sizes do not fit together, or
            ``cache`` comes with ``context`` (or a ragged cache with a mask).
        TypeError: an array differs from ``x`` in library, device or dtype.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> rng = np.random.default_rng(0)
        >>> x = rng.standard_normal((1, 8, 16), dtype=np.float32)
        >>> w_q, w_o = (rng.standard_normal((16, 16), dtype=np.float32) for _ in range(2))
        >>> w_k, w_v = (rng.standard_normal((16, 8), dtype=np.float32) for _ in range(2))
        >>> y = portattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=4,
        ...                                   num_kv_heads=2, mask=masks.causal())
        >>> y.shape
        (1, 8, 16)

        The last position attends the whole sequence, so it does not depend on the
        mask:

        >>> full = portattn.multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads=4,
        ...                                      num_kv_heads=2)
        >>> bool(np.allclose(y[:, -1], full[:, -1], atol=1e-5))
        True
    """
    xp, dev = namespace_of(x, "x", 2)
    arrays = {"w_q": w_q, "w_k": w_k, "w_v": w_v, "w_o": w_o, "b_q": b_q, "b_k": b_k,
              "b_v": b_v, "b_o": b_o, "context": context, "value_context": value_context}
    for name, a in arrays.items():
        if a is not None:
            check_same(xp, dev, x, a, name, "x")
    dims = dimensions(w_q, w_k, w_v, w_o, num_heads, num_kv_heads,
                      {n: arrays[n] for n in BIASES})
    d_model, d_context, kv_heads = dims.d_model, dims.d_context, dims.num_kv_heads
    check_features("x", x, d_model, "w_q.shape[0]")
    source = x
    if context is not None:
        check_features("context", context, d_context, "w_k.shape[0]")
        if tuple(context.shape[:-2]) != tuple(x.shape[:-2]):
            msg = (f"context must share x's leading batch dims; got x.shape="
                   f"{tuple(x.shape)}, context.shape={tuple(context.shape)}")
            raise ValueError(msg)
        if cache is not None:
            msg = "cache holds self-attention keys and values; got both context and cache"
            raise ValueError(msg)
        source = context
    elif d_context != d_model:
        msg = (f"w_k.shape[0]={d_context} differs from d_model={d_model}; pass context= "
               "for cross-attention with a different feature size")
        raise ValueError(msg)
    value_source = _value_source(source, context, value_context, dims.d_value_context,
                                 d_context)
    mask, bias = additive_mask(xp, mask, bias)
    if isinstance(cache, PagedStep):
        return _paged_step(xp, x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, num_heads,
                           kv_heads, cache, mask, bias, scale, kernel)

    q = _split_heads(xp, _project(xp, x, w_q, b_q), num_heads)
    k = _split_heads(xp, _project(xp, source, w_k, b_k), kv_heads)
    v = _split_heads(xp, _project(xp, value_source, w_v, b_v), kv_heads)
    if cache is not None:
        ragged = cache.lengths is not None
        if ragged and mask is not None:
            msg = (f"a ragged KVCache brings its own mask (causal per sequence, its padding "
                   f"hidden); pass mask=None with it, got mask={mask!r}")
            raise ValueError(msg)
        k, v = cache.append(k, v)
        if ragged:  # aligned to the lengths after this step's positions
            mask = cache.mask(q.shape[-2])
    out = attention(q, k, v, mask=mask, bias=bias, scale=scale, kernel=kernel)
    return _project(xp, _merge_heads(xp, out), w_o, b_o)


def _paged_step(xp: Any, x: Any, w_q: Any, w_k: Any, w_v: Any, w_o: Any, b_q: Any, b_k: Any,
                b_v: Any, b_o: Any, num_heads: int, kv_heads: int, step: PagedStep,
                mask: Any, bias: Any, scale: float | None, kernel: str | None) -> Any:
    """A pass over packed tokens ``x (T, d_model)`` of a paged cache's sequences."""
    if x.ndim != 2:
        msg = (f"with a paged cache step, x holds the packed tokens, (T, d_model); got "
               f"x.shape={tuple(x.shape)}")
        raise ValueError(msg)
    for name, given in (("bias", bias), ("kernel", kernel)):
        if given is not None:
            msg = (f"a paged cache step runs portattn.paged_attention, which takes no "
                   f"{name}; got {name}={given!r}")
            raise ValueError(msg)
    check_mask(mask)  # before the cache is written
    total = x.shape[0]

    def heads(a: Any, count: int) -> Any:  # (T, H * d) -> (T, H, d)
        return xp.reshape(a, (total, count, a.shape[-1] // count))

    step.append(heads(_project(xp, x, w_k, b_k), kv_heads),
                heads(_project(xp, x, w_v, b_v), kv_heads))
    out = step.attention(heads(_project(xp, x, w_q, b_q), num_heads), mask=mask, scale=scale)
    return _project(xp, xp.reshape(out, (total, -1)), w_o, b_o)


def _value_source(source: Any, context: Any, value_context: Any, d_value: int,
                  d_context: int) -> Any:
    """The input the values are projected from: ``value_context`` when given."""
    if value_context is None:
        if d_value != d_context:
            msg = (f"w_v.shape[0]={d_value} differs from w_k.shape[0]={d_context}; pass "
                   "value_context= for values from an input of another feature size "
                   "(torch's vdim)")
            raise ValueError(msg)
        return source
    if context is None:
        msg = "value_context needs context= too (the keys' input); got value_context only"
        raise ValueError(msg)
    check_features("value_context", value_context, d_value, "w_v.shape[0]")
    if tuple(value_context.shape[:-1]) != tuple(context.shape[:-1]):
        msg = (f"value_context must match context's batch dims and length; got "
               f"context.shape={tuple(context.shape)}, "
               f"value_context.shape={tuple(value_context.shape)}")
        raise ValueError(msg)
    return value_context


def additive_mask(xp: Any, mask: Any, bias: Any) -> tuple[Any, Any]:
    """``(mask, bias)`` with a float array given as ``mask`` moved to ``bias`` (torch's
    float ``attn_mask`` is added to the scores)."""
    from .masks import Mask

    if mask is None or isinstance(mask, Mask) or not hasattr(mask, "dtype") \
            or not xp.isdtype(mask.dtype, "real floating"):
        return mask, bias
    if bias is not None:
        msg = "a float mask is added to the scores like bias; pass one of mask= and bias="
        raise ValueError(msg)
    return None, mask


def _project(xp: Any, a: Any, w: Any, b: Any) -> Any:
    y = xp.matmul(a, w)
    return y if b is None else y + b


def _split_heads(xp: Any, a: Any, heads: int) -> Any:
    """``(..., L, H * d) -> (..., H, L, d)``."""
    *batch, length, features = a.shape
    a = xp.reshape(a, (*batch, length, heads, features // heads))
    n = a.ndim
    return xp.permute_dims(a, (*range(n - 3), n - 2, n - 3, n - 1))


def _merge_heads(xp: Any, a: Any) -> Any:
    """``(..., H, L, d) -> (..., L, H * d)``."""
    n = a.ndim
    a = xp.permute_dims(a, (*range(n - 3), n - 2, n - 3, n - 1))
    *batch, length, heads, dim = a.shape
    return xp.reshape(a, (*batch, length, heads * dim))


class MultiHeadAttention:
    """A multi-head attention layer holding its weights in any library.

    ``layer(x, context=None, mask=None, cache=None, *, value_context=None, bias=None)``
    is :func:`multi_head_attention` with the layer's weights, and takes the same
    arguments. Make one from a seed with :meth:`init` or from arrays with the
    constructor; ``portattn_torch`` converts it from and to a torch
    ``nn.MultiheadAttention``.

    Args:
        w_q: ``(d_model, num_heads * head_dim)``; the other weights and biases as in
            :func:`multi_head_attention`, all in ``w_q``'s library, device and dtype.
        w_k: ``(d_context, num_kv_heads * head_dim)``.
        w_v: ``(d_value_context, num_kv_heads * dv)``.
        w_o: ``(num_heads * dv, d_out)``.
        num_heads: query heads.
        num_kv_heads: key/value heads (default ``num_heads``); must divide ``num_heads``.
        b_q: optional bias of the query projection.
        b_k: optional bias of the key projection.
        b_v: optional bias of the value projection.
        b_o: optional bias of the output projection.
        scale: score scale, default ``1/sqrt(head_dim)``.
        kernel: force an attention kernel by name.

    Raises:
        ValueError: shapes and head counts do not fit together.
        TypeError: an array differs from ``w_q`` in library, device or dtype.

    Example:
        >>> import numpy as np
        >>> from portattn import MultiHeadAttention, masks
        >>> layer = MultiHeadAttention.init(16, num_heads=4, num_kv_heads=2, seed=0)
        >>> layer.num_heads, layer.num_kv_heads, layer.head_dim
        (4, 2, 4)
        >>> x = np.random.default_rng(0).standard_normal((1, 8, 16), dtype=np.float32)
        >>> y = layer(x, mask=masks.causal())
        >>> y.shape
        (1, 8, 16)

        Decoding with a cache gives the rows of the causal pass:

        >>> cache = layer.new_cache(1, capacity=8)
        >>> first = layer(x[:, :5], mask=masks.causal(), cache=cache)
        >>> step = layer(x[:, 5:6], mask=masks.causal(), cache=cache)
        >>> bool(np.allclose(step, y[:, 5:6], atol=1e-5))
        True
    """

    def __init__(self, w_q: Any, w_k: Any, w_v: Any, w_o: Any, *, num_heads: int,
                 num_kv_heads: int | None = None, b_q: Any = None, b_k: Any = None,
                 b_v: Any = None, b_o: Any = None, scale: float | None = None,
                 kernel: str | None = None) -> None:
        params = {"w_q": w_q, "w_k": w_k, "w_v": w_v, "w_o": w_o,
                  "b_q": b_q, "b_k": b_k, "b_v": b_v, "b_o": b_o}
        xp, dev = namespace_of(w_q, "w_q", 2)
        for name, a in params.items():
            if a is not None and name != "w_q":
                check_same(xp, dev, w_q, a, name, "w_q")
        dims = dimensions(w_q, w_k, w_v, w_o, num_heads, num_kv_heads,
                          {n: params[n] for n in BIASES})
        (self.d_model, self.d_context, self.head_dim, self.value_head_dim, kv,
         self.d_value_context) = dims
        self.num_heads, self.num_kv_heads = num_heads, kv
        self.scale, self.kernel = scale, kernel
        self.params = {n: a for n, a in params.items() if a is not None}

    @classmethod
    def init(cls, d_model: int, num_heads: int, num_kv_heads: int | None = None, *,
             kdim: int | None = None, vdim: int | None = None,
             bias: bool = True, seed: int = 0, xp: Any = None, device: Any = None,
             dtype: Any = "float32", scale: float | None = None,
             kernel: str | None = None) -> MultiHeadAttention:
        """A layer with Xavier-uniform weights and zero biases.

        The weights come from ``numpy.random.default_rng(seed)``, so a seed gives the
        same layer in every library.

        Args:
            d_model: feature size of the input and the output; a multiple of
                ``num_heads`` (``head_dim = d_model // num_heads``).
            num_heads: query heads.
            num_kv_heads: key/value heads (default ``num_heads``).
            kdim: feature size of the keys' input (default ``d_model``), as in torch.
            vdim: feature size of the values' input (default ``d_model``).
            bias: whether the layer has (zero) projection biases.
            seed: the NumPy generator's seed.
            xp: the array namespace to place the weights in; NumPy when None.
            device: where to place them; the library's default when None.
            dtype: a dtype or its name.
            scale: score scale, default ``1/sqrt(head_dim)``.
            kernel: force an attention kernel by name.

        Returns:
            The :class:`MultiHeadAttention` layer.

        Raises:
            ValueError: a size is not a positive int, or ``d_model`` is not divisible
                by ``num_heads``.

        Example:
            >>> from portattn import MultiHeadAttention
            >>> layer = MultiHeadAttention.init(32, 8, 2, bias=False)
            >>> layer.head_dim, layer.num_kv_heads, sorted(layer.params)
            (4, 2, ['w_k', 'w_o', 'w_q', 'w_v'])
            >>> layer.params["w_k"].shape
            (32, 8)
        """
        import numpy as np

        d_model, heads = count("d_model", d_model), count("num_heads", num_heads)
        kv_heads = heads if num_kv_heads is None else count("num_kv_heads", num_kv_heads)
        if d_model % heads:
            msg = f"d_model={d_model} is not divisible by num_heads={heads}"
            raise ValueError(msg)
        head_dim = d_model // heads
        rng = np.random.default_rng(seed)
        d_key = d_model if kdim is None else count("kdim", kdim)
        d_value = d_model if vdim is None else count("vdim", vdim)
        shapes = {"w_q": (d_model, d_model), "w_k": (d_key, kv_heads * head_dim),
                  "w_v": (d_value, kv_heads * head_dim), "w_o": (d_model, d_model)}
        host = {}
        for name, (fan_in, fan_out) in shapes.items():
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            host[name] = rng.uniform(-limit, limit, size=(fan_in, fan_out))
        if bias:
            host.update({b: np.zeros(shapes[w][1]) for w, b in zip(WEIGHTS, BIASES,
                                                                   strict=True)})
        ns = namespace(xp)
        resolve_dtype(ns, dtype)
        params = {n: place(a, ns, device=device, dtype=dtype) for n, a in host.items()}
        return cls(**params, num_heads=heads, num_kv_heads=kv_heads, scale=scale,
                   kernel=kernel)

    @property
    def xp(self) -> Any:
        """The array namespace holding the weights."""
        return namespace_of(self.params["w_q"], "w_q", 2)[0]

    @property
    def device(self) -> Any:
        """The device of the weights."""
        return safe_device(self.params["w_q"])

    @property
    def dtype(self) -> Any:
        """The dtype of the weights."""
        return self.params["w_q"].dtype

    def to(self, xp: Any = None, *, device: Any = None, dtype: Any = None) -> MultiHeadAttention:
        """A copy of the layer with its weights in another library, device or dtype.

        Args:
            xp: the array namespace to move the weights to; NumPy when None.
            device: the device to place them on; the library's default when None.
            dtype: the new dtype (or its name); unchanged when None.

        Returns:
            A new :class:`MultiHeadAttention`; this one is left as it was.

        Example:
            >>> import numpy as np
            >>> from portattn import MultiHeadAttention
            >>> layer = MultiHeadAttention.init(16, 4)
            >>> layer.to(np, dtype="float64")
            MultiHeadAttention(d_model=16, num_heads=4, head_dim=4, bias=True, dtype=float64)
        """
        ns = namespace(xp)
        params = {n: place(a, ns, device=device, dtype=dtype) for n, a in self.params.items()}
        return type(self)(**params, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                          scale=self.scale, kernel=self.kernel)

    def __call__(self, x: Any, context: Any = None, mask: Mask | Any = None,
                 cache: KVCache | PagedStep | None = None, *, value_context: Any = None,
                 bias: Any = None) -> Any:
        return multi_head_attention(x, **self.params, num_heads=self.num_heads,
                                    num_kv_heads=self.num_kv_heads, context=context,
                                    value_context=value_context, mask=mask, bias=bias,
                                    scale=self.scale, kernel=self.kernel, cache=cache)

    def new_cache(self, batch_shape: int | tuple[int, ...], capacity: int) -> KVCache:
        """An empty :class:`portattn.KVCache` for this layer's keys and values.

        Args:
            batch_shape: the batch dims of the inputs, an int or a tuple.
            capacity: positions to hold.

        Returns:
            A cache in the layer's library, device and dtype, with its key/value heads
            and head dims.

        Example:
            >>> from portattn import MultiHeadAttention
            >>> MultiHeadAttention.init(16, 4, 2).new_cache(3, capacity=10)
            KVCache(shape=(3, 2, 10, 4), value_head_dim=4, length=0, dtype=float32)
        """
        from .kv_cache import KVCache

        return KVCache.empty(batch_shape, self.num_kv_heads, self.head_dim, capacity,
                             value_head_dim=self.value_head_dim, xp=self.xp,
                             dtype=self.dtype, device=self.device)

    def new_paged_cache(self, page_size: int, *, num_pages: int = 16,
                        layout: str = "blhd") -> PagedKVCache:
        """An empty :class:`portattn.PagedKVCache` for this layer's keys and values; a
        forward pass takes one of its steps (:meth:`PagedKVCache.step`) as ``cache``.

        Args:
            page_size: tokens per page.
            num_pages: pages to start with; the pool doubles when they run out.
            layout: ``"blhd"`` or ``"bhld"`` (:meth:`PagedKVCache.empty`).

        Returns:
            A cache in the layer's library, device and dtype, with its key/value heads
            and head dims.
        """
        from .paged_cache import PagedKVCache

        return PagedKVCache.empty(page_size, self.num_kv_heads, self.head_dim,
                                  value_head_dim=self.value_head_dim, num_pages=num_pages,
                                  layout=layout, xp=self.xp, dtype=self.dtype,
                                  device=self.device)

    def __repr__(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        return (f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}{kv}, "
                f"head_dim={self.head_dim}, bias={'b_q' in self.params}, "
                f"dtype={dtype_name(self.dtype)})")
