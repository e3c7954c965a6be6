"""The public attention functions."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .. import masks
from .._dispatch import Plan, check_result, described_and_chosen, select
from .._inputs import describe, from_kernel_layout, to_kernel_layout
from .._kernels import distrust, max_scores
from .._lib import dtype_name, namespace_name

if TYPE_CHECKING:
    from .._inputs import AttentionInputs
    from ..masks import Mask
    from ..scores import ScoreChange

__all__ = ["attention", "explain", "scaled_dot_product_attention"]


def attention(query: Any, key: Any, value: Any, /, *, mask: Mask | None = None,
              bias: Any = None, scale: float | None = None, softcap: float | None = None,
              return_lse: bool = False, return_weights: bool = False,
              dropout_p: float = 0.0, dropout_seed: Any = None, alibi_slopes: Any = None,
              sinks: Any = None, score_mod: ScoreChange | None = None, layout: str = "bhld",
              assume_finite: bool = False, return_max_scores: bool = False,
              kernel: str | None = None) -> Any:
    """Exact scaled-dot-product attention on any Array API library.

    The namespace of the arrays decides which library runs; the best installed kernel
    that can honour the call runs it (:func:`explain` says which). ``Hq`` must be a
    multiple of ``Hkv`` (grouped-query attention; keys and values are never copied per
    head).

    Args:
        query: ``(..., Hq, Lq, D)``.
        key: ``(..., Hkv, Lk, D)``.
        value: ``(..., Hkv, Lk, Dv)``.
        mask: a :mod:`portattn.masks` mask (``causal()``, ``sliding_window(...)``,
            ``key_lengths(...)``, ... combined with ``&`` and ``|``) or a boolean array
            (True = attend). Fully masked rows give 0 and a log-sum-exp of ``-inf``.
        bias: float array added to the scores, broadcastable to ``(..., Hq, Lq, Lk)``.
        scale: multiplies ``q @ k^T``; defaults to ``1/sqrt(D)``.
        softcap: scores become ``softcap * tanh(s / softcap)`` (after scaling, before
            bias and mask).
        return_lse: also return the natural log-sum-exp of the final scores,
            ``(..., Hq, Lq)``, in float32 for half-precision inputs.
        return_weights: also return the softmax matrix; materialises ``Lq x Lk``.
            With dropout, the weights as applied (dropped ones 0, kept ones divided
            by ``1 - dropout_p``), so that ``out == weights @ value``.
        dropout_p: the probability of dropping each weight (the kept ones are divided
            by ``1 - dropout_p``); the lse is that of the weights before dropout.
        dropout_seed: what dropout's mask is drawn from: an int or an integer array
            of up to four words (a JAX PRNG key: typed or legacy). The same seed
            drops the same pairs in every kernel that takes one (:mod:`portattn.dropout`),
            forward and backward. None on torch draws one from torch's generator
            (``torch.manual_seed`` applies); other libraries need one.
        alibi_slopes: ALiBi, ``(Hq,)`` or ``(*batch, Hq)``: ``-slope * |i + Lk - Lq - j|``
            joins the score of query ``i`` and key ``j`` (with the bias, after softcap),
            as flash-attn defines it; computed per tile, never as an ``Lq x Lk`` array.
            Constants: no gradient flows to them.
        sinks: learned attention sinks, ``(Hq,)`` or ``(*batch, Hq)``: each row's softmax
            denominator gains ``exp(sinks[h])``, a logit that attends no value (gpt-oss).
            The lse includes it (so a fully masked row gives 0 and an lse of ``sinks``);
            gradients flow to it.
        score_mod: a :mod:`portattn.scores` change (T5's relative positions, Swin's
            window table, a pair table, learned ALiBi slopes, their sums): entries
            from small learned tables join the scores (after softcap, with the bias),
            computed per tile, never as an ``Lq x Lk`` array; its tables get
            gradients.
        layout: ``"bhld"`` for the shapes above, ``"blhd"`` for arrays held as
            ``(..., length, heads, head_dim)`` (flash-attn's and JAX's layout): the
            output is then ``(..., Lq, Hq, Dv)``, a transposed view of the kernel's
            (no copy of the inputs or the output where the library has strides); the
            lse stays ``(..., Hq, Lq)`` and the weights ``(..., Hq, Lq, Lk)``.
        assume_finite: the caller's word that ``query``, ``key``, ``value`` and ``bias``
            hold no NaN or inf. Kernels then skip what keeps the rule for non-finite
            inputs (a pass over the inputs or the output, and on an accelerator or
            under ``torch.compile`` a copy of the keys and values); with a non-finite
            input anyway, rows the mask would have kept finite may come out NaN.
        return_max_scores: also return each query row's largest score after every
            change (scale, softcap, bias, ALiBi, ``score_mod``) over the keys it sees,
            ``(..., Hq, Lq)`` in the dtype of the lse, ``-inf`` where it sees none (for
            checks such as QK-clip). A constant (no gradient flows through it),
            computed in one more pass over the scores' products, not from the
            kernel's own.
        kernel: run this kernel by name instead of choosing one.

    Returns:
        ``out`` ``(..., Hq, Lq, Dv)`` in the dtype of ``query``; with ``return_lse``,
        ``return_weights`` or ``return_max_scores``, a tuple ``(out, lse, weights,
        max_scores)`` holding only the requested parts, in that order.

    Raises:
        TypeError: an argument has the wrong type or dtype, or the arrays come from
            different libraries.
        ValueError: shapes, head counts or option values do not fit together.
        ~portattn.errors.NoKernelError: no installed kernel can honour the call.
        ~portattn.errors.KernelNotUsableError: the kernel forced by name cannot run it
            (:class:`~portattn.errors.UnknownKernelError` when no kernel has that name).

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> k = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> v = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> out, lse = portattn.attention(q, k, v, mask=masks.causal(), return_lse=True)
        >>> out.shape, lse.shape, out.dtype
        ((1, 2, 8, 4), (1, 2, 8), dtype('float32'))

        Under the causal mask the first query sees only the first key, so its output
        is that key's value:

        >>> bool(np.allclose(out[..., 0, :], v[..., 0, :]))
        True

        Grouped-query attention: four query heads share two key/value heads.

        >>> q4 = rng.standard_normal((1, 4, 8, 4), dtype=np.float32)
        >>> portattn.attention(q4, k, v).shape
        (1, 4, 8, 4)
    """
    options = {"mask": mask, "bias": bias, "scale": scale, "softcap": softcap,
               "return_lse": return_lse, "return_weights": return_weights,
               "dropout_p": dropout_p, "alibi_slopes": alibi_slopes, "sinks": sinks,
               "layout": layout, "assume_finite": assume_finite}
    if score_mod is not None:  # kept out of the remembered signature otherwise
        options["score_mod"] = score_mod
    if return_max_scores is not False:
        options["return_max_scores"] = return_max_scores
    if dropout_seed is not None:  # kept out of the remembered signature otherwise
        options["dropout_seed"] = dropout_seed
    query, key, value = to_kernel_layout(layout, query, key, value)
    inputs, entry = described_and_chosen(query, key, value, options, kernel)
    try:
        out, lse, weights = entry.kernel.run(inputs)
    except Exception as e:
        _name_the_kernel(e, entry)
        raise
    check_result(entry, inputs, out, lse, weights)
    if entry.kernel.finite_inputs_only and (why := distrust(inputs, out)) is not None:
        out, lse, weights = _exactly(inputs, kernel, why)
    out = from_kernel_layout(inputs.xp, layout, out)
    if not (return_lse or return_weights or inputs.return_max_scores):
        return out
    extras = ((lse,) if return_lse else ()) + ((weights,) if return_weights else ())
    if inputs.return_max_scores:
        extras += (max_scores(inputs),)
    return (out, *extras)


def explain(query: Any, key: Any, value: Any, /, **kwargs: Any) -> Plan:
    """The kernel :func:`attention` would run with these arguments, and why the others
    would not; computes nothing.

    Args:
        query: as for :func:`attention`.
        key: as for :func:`attention`.
        value: as for :func:`attention`.
        **kwargs: any keyword argument of :func:`attention`, ``kernel`` included.

    Returns:
        A :class:`~portattn.Plan`: ``plan.kernel`` is the chosen kernel's entry (None
        when no kernel fits), ``plan.candidates`` every kernel with its reasons, and
        ``str(plan)`` a report of both.

    Raises:
        TypeError: as :func:`attention` does for the same arguments.
        ValueError: as :func:`attention` does for the same arguments.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> from portattn import masks
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> plan = portattn.explain(q, q, q, mask=masks.causal(), kernel="tiled")
        >>> plan.kernel.name, plan.forced
        ('tiled', 'tiled')
        >>> print(str(plan).splitlines()[2])
            query : shape=(1, 2, 8, 4) dtype=float32 namespace=numpy device=cpu
        >>> plan = portattn.explain(q, q, q, return_weights=True, kernel="tiled")
        >>> print(plan.kernel)
        None
    """
    kernel = kwargs.pop("kernel", None)
    layout = kwargs.get("layout", "bhld")
    query, key, value = to_kernel_layout(layout, query, key, value)
    return replace(select(describe(query, key, value, **kwargs), kernel), layout=layout)


def _name_the_kernel(error: Exception, entry: Any) -> None:
    """Say in ``error``'s traceback which kernel raised it (Python 3.11+ notes)."""
    if hasattr(error, "add_note"):
        error.add_note(f"raised by kernel {entry}")


def _exactly(inputs: AttentionInputs, kernel: str | None, why: str) -> tuple[Any, Any, Any]:
    """``(out, lse, weights)`` from a kernel that follows the rule for non-finite
    inputs, after one exact on finite inputs only gave an answer that may break it."""
    plan = select(inputs, kernel, every=False, nonfinite=why)
    if plan.kernel is None:
        raise plan.error()
    logging.getLogger("portattn").debug("attention: rerun on %s: %s", plan.kernel.name, why)
    out, lse, weights = plan.kernel.kernel.run(inputs)
    check_result(plan.kernel, inputs, out, lse, weights)
    return out, lse, weights


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 dropout_seed: Any = None) -> Any:
    """``torch.nn.functional.scaled_dot_product_attention`` semantics on any library.

    Unlike torch, ``attn_mask`` and ``is_causal`` may be combined.

    Args:
        query: ``(..., Hq, Lq, D)``.
        key: ``(..., Hkv, Lk, D)``.
        value: ``(..., Hkv, Lk, Dv)``.
        attn_mask: a boolean array (True = attend), a float array added to the
            scores, or torch's ``CausalBias`` (``causal_upper_left`` /
            ``causal_lower_right``); broadcastable to ``(..., Hq, Lq, Lk)``.
        dropout_p: the probability of dropping each weight.
        is_causal: hide keys ``j > i`` from query ``i`` (top-left aligned, as torch).
        scale: multiplies ``q @ k^T``; defaults to ``1/sqrt(D)``.
        enable_gqa: allow ``Hq != Hkv`` (``Hq`` a multiple of ``Hkv``).
        dropout_seed: as for :func:`attention` (torch draws one from its generator
            when it is None; other libraries need one for dropout).

    Returns:
        The output ``(..., Hq, Lq, Dv)``.

    Raises:
        ValueError: ``Hq != Hkv`` without ``enable_gqa``, or a ``CausalBias`` together
            with ``is_causal`` or for other lengths than the call's.
        TypeError: ``attn_mask`` is neither boolean nor real floating.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> rng = np.random.default_rng(0)
        >>> q = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> k = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> v = rng.standard_normal((1, 2, 8, 4), dtype=np.float32)
        >>> out = portattn.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> out.shape
        (1, 2, 8, 4)
        >>> allowed = np.tril(np.ones((8, 8), dtype=bool))
        >>> same = portattn.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        >>> bool(np.allclose(out, same, atol=1e-6))
        True
    """
    q_heads, kv_heads = _heads(query, "query"), _heads(key, "key")
    if min(q_heads, kv_heads) >= 0 and q_heads != kv_heads and not enable_gqa:
        msg = (f"query has {q_heads} heads but key has {kv_heads}; pass enable_gqa=True "
               "for grouped-query attention")
        raise ValueError(msg)
    mask, bias = None, None
    causal_bias = _causal_bias(attn_mask, query, key)
    if causal_bias is not None:
        if is_causal:
            msg = ("attn_mask is torch's CausalBias, a causal mask already; pass it or "
                   "is_causal=True, not both")
            raise ValueError(msg)
        mask, attn_mask = causal_bias, None
    if attn_mask is not None:
        xp = _namespace(attn_mask)
        try:
            boolean = xp.isdtype(attn_mask.dtype, "bool")
            floating = not boolean and xp.isdtype(attn_mask.dtype, "real floating")
        except TypeError:  # NumPy's and CuPy's isdtype refuse ml_dtypes' bfloat16
            boolean = floating = None
        if boolean:
            mask = masks.dense(attn_mask)
        elif floating:
            bias = attn_mask
        else:
            msg = ("attn_mask must be boolean (True = attend) or a real floating bias; got "
                   f"attn_mask.dtype={dtype_name(attn_mask.dtype)}")
            if floating is None:
                msg += f", which {namespace_name(xp)}.isdtype does not know"
            raise TypeError(msg)
    if is_causal:
        mask = masks.causal("top_left") if mask is None else mask & masks.causal("top_left")
    return attention(query, key, value, mask=mask, bias=bias, scale=scale,
                     dropout_p=dropout_p, dropout_seed=dropout_seed)


def _causal_bias(attn_mask: Any, query: Any, key: Any) -> Mask | None:
    """The causal mask of torch's ``causal_upper_left``/``causal_lower_right``
    (``torch.nn.attention.bias.CausalBias``), or None for any other ``attn_mask``."""
    import sys

    bias_module = sys.modules.get("torch.nn.attention.bias")
    kind = getattr(bias_module, "CausalBias", None)
    if kind is None or not isinstance(attn_mask, kind):
        return None
    lq, lk = getattr(query, "shape", (0, 0))[-2], getattr(key, "shape", (0, 0))[-2]
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (lq, lk):
        msg = (f"attn_mask is a CausalBias for (Lq, Lk) = ({attn_mask.seq_len_q}, "
               f"{attn_mask.seq_len_kv}); the call has ({lq}, {lk})")
        raise ValueError(msg)
    upper_left = attn_mask.variant == bias_module.CausalVariant.UPPER_LEFT
    return masks.causal("top_left" if upper_left else "bottom_right")


def _namespace(x: Any) -> Any:
    from array_api_compat import array_namespace

    try:
        return array_namespace(x)
    except TypeError as e:
        msg = f"attn_mask must be an array; got {type(x).__name__}"
        raise TypeError(msg) from e


def _heads(x: Any, name: str) -> int:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 3:
        # Not an array, or too few dims: attention() says which, in its own words.
        return -1
    return shape[-3]
