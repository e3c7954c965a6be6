"""Conversion between :class:`MultiHeadAttention` weights and the state dict of a torch
``nn.MultiheadAttention``.

torch stores ``W^T`` (``nn.Linear`` convention, ``y = x @ W.T + b``) and packs the three
input projections into ``in_proj_weight`` ``(3E, E)`` when keys and values have the
embedding size, or keeps ``q/k/v_proj_weight`` apart when ``kdim``/``vdim`` differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from array_api_compat import array_namespace, is_torch_array

from ._convert import to_host
from ._inputs import dtype_name

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .multihead import MultiHeadAttention

__all__ = ["params_from_torch", "params_to_torch"]

_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def params_from_torch(state_dict: Mapping[str, Any], num_heads: int) -> dict[str, Any]:
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


def params_to_torch(layer: MultiHeadAttention) -> dict[str, Any]:
    """The state dict of the equivalent ``nn.MultiheadAttention`` (torch tensors)."""
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
    return {name: _to_torch(torch, a) for name, a in sd.items()}


def _t(xp: Any, a: Any) -> Any:
    return xp.permute_dims(a, (1, 0))


def _to_torch(torch: Any, a: Any) -> Any:
    if is_torch_array(a):
        return a.detach().clone().contiguous()
    import numpy as np

    host = np.array(to_host(a), copy=True)  # writable, owned by the tensor
    return torch.from_numpy(host).to(getattr(torch, dtype_name(a.dtype)))
