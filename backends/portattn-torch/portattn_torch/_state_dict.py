"""Conversion between a :class:`portattn.MultiHeadAttention` and the state dict of a torch
``nn.MultiheadAttention``.

torch stores ``W^T`` (``nn.Linear`` convention, ``y = x @ W.T + b``) and packs the three
input projections into ``in_proj_weight`` ``(3E, E)`` when keys and values have the
embedding size, or keeps ``q/k/v_proj_weight`` apart when ``kdim``/``vdim`` differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace

from portattn import MultiHeadAttention

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["from_torch_state_dict", "to_torch_state_dict"]

_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def from_torch_state_dict(state_dict: Mapping[str, Any], num_heads: int, *, xp: Any = None,
                          device: Any = None, dtype: Any = None) -> MultiHeadAttention:
    """A layer equal to a torch ``nn.MultiheadAttention`` with this state dict.

    The module must have been made with ``batch_first=True`` for ``layer(x)`` to take
    the same input; its weights may live in any library. ``xp``, ``device`` and
    ``dtype`` default to the state dict's own.
    """
    layer = MultiHeadAttention(**_params(state_dict), num_heads=num_heads)
    return layer.to(layer.xp if xp is None else xp, device=device, dtype=dtype)


def _params(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``w_q, w_k, w_v, w_o`` (and biases) as ``x @ W`` arrays in the state dict's library."""
    sd = dict(state_dict)
    extra = sorted(k for k in ("bias_k", "bias_v") if k in sd)
    if extra:
        msg = (f"nn.MultiheadAttention(add_bias_kv=True) is not supported; the state dict "
               f"has {extra}")
        raise ValueError(msg)
    if "in_proj_weight" in sd:
        packed = sd["in_proj_weight"]
        if len(packed.shape) != 2 or packed.shape[0] != 3 * packed.shape[1]:
            msg = (f"in_proj_weight must have shape (3 * embed_dim, embed_dim); got "
                   f"in_proj_weight.shape={tuple(packed.shape)}")
            raise ValueError(msg)
        e = packed.shape[1]
        q, k, v = packed[:e, :], packed[e:2 * e, :], packed[2 * e:, :]
    elif all(name in sd for name in _SEPARATE):
        q, k, v = (sd[name] for name in _SEPARATE)
    else:
        msg = (f"state_dict must hold 'in_proj_weight' (or {', '.join(_SEPARATE)}) and "
               f"'out_proj.weight' of an nn.MultiheadAttention; got keys {sorted(sd)}")
        raise ValueError(msg)
    if "out_proj.weight" not in sd:
        msg = f"state_dict has no 'out_proj.weight'; got keys {sorted(sd)}"
        raise ValueError(msg)
    xp = array_namespace(q)
    params = {"w_q": _t(xp, q), "w_k": _t(xp, k), "w_v": _t(xp, v),
              "w_o": _t(xp, sd["out_proj.weight"])}
    packed_bias = sd.get("in_proj_bias")
    if packed_bias is not None:
        nq, nk = params["w_q"].shape[1], params["w_k"].shape[1]
        params.update(b_q=packed_bias[:nq], b_k=packed_bias[nq:nq + nk],
                      b_v=packed_bias[nq + nk:])
    if sd.get("out_proj.bias") is not None:
        params["b_o"] = sd["out_proj.bias"]
    return params


def to_torch_state_dict(layer: MultiHeadAttention) -> dict[str, Any]:
    """The state dict of an equivalent torch ``nn.MultiheadAttention`` (torch tensors).

    Load it into ``nn.MultiheadAttention(d_model, num_heads, bias=..., kdim=...,
    vdim=..., batch_first=True)``; torch has no grouped-query form, so this needs
    ``num_kv_heads == num_heads``. Tensors of a torch layer stay on its device; those of
    another library's layer are copied to the CPU.
    """
    embed = layer.num_heads * layer.head_dim
    problems = []
    if layer.num_kv_heads != layer.num_heads:
        problems.append(f"num_kv_heads={layer.num_kv_heads} != num_heads={layer.num_heads} "
                        "(torch has no grouped-query form)")
    if layer.value_head_dim != layer.head_dim:
        problems.append(f"value_head_dim={layer.value_head_dim} != head_dim={layer.head_dim}")
    if layer.d_model != embed or tuple(layer.params["w_o"].shape) != (embed, embed):
        problems.append(f"d_model={layer.d_model} and w_o.shape="
                        f"{tuple(layer.params['w_o'].shape)} must both match "
                        f"num_heads * head_dim = {embed}")
    if problems:
        msg = "nn.MultiheadAttention cannot hold this layer: " + "; ".join(problems)
        raise ValueError(msg)
    import torch

    # The layer's own copy in torch (fresh tensors, on the layer's device when it is torch).
    layer = layer.to(array_namespace(torch.empty(0)))
    xp, p = layer.xp, layer.params
    w = {n: _t(xp, p[n]) for n in ("w_q", "w_k", "w_v", "w_o")}
    sd: dict[str, Any] = {}
    if layer.d_context == embed:
        sd["in_proj_weight"] = xp.concat([w["w_q"], w["w_k"], w["w_v"]], axis=0)
    else:
        sd.update(zip(_SEPARATE, (w["w_q"], w["w_k"], w["w_v"]), strict=True))
    if any(b in p for b in ("b_q", "b_k", "b_v", "b_o")):
        # torch has all biases or none; a missing one is an all-zero one.
        def bias(name: str, size: int) -> Any:
            if name in p:
                return p[name]
            return xp.zeros((size,), dtype=layer.dtype, device=layer.device)

        sd["in_proj_bias"] = xp.concat([bias(n, embed) for n in ("b_q", "b_k", "b_v")])
        sd["out_proj.bias"] = bias("b_o", embed)
    sd["out_proj.weight"] = w["w_o"]
    return {name: a.detach().contiguous() for name, a in sd.items()}


def _t(xp: Any, a: Any) -> Any:
    return xp.permute_dims(a, (1, 0))
