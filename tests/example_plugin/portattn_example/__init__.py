"""A whole kernel plugin: NumPy einsum attention with causal and sliding-window masks."""

import numpy as np

from portattn.kernel import Kernel


class EinsumKernel(Kernel):
    name = "example_einsum"  # the entry-point name
    namespaces = frozenset({"numpy"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float32", "float64"})
    masks = frozenset({"causal", "sliding_window"})  # every positional mask: one band
    returns_lse = True
    finite_inputs_only = True  # 0 * inf in the product: portattn checks the values
    priority = 5  # below the built-in tiled kernel: runs when asked for by name
    calls = 0

    def run(self, inputs):
        type(self).calls += 1
        q, k, v = inputs.query, inputs.key, inputs.value
        lq, lk = inputs.q_len, inputs.kv_len
        s = np.einsum("...qd,...kd->...qk", q, k) * inputs.scale
        if inputs.mask is not None:
            # lower <= j - i <= upper, alignment and any shift already folded in
            band = inputs.mask.band(lq, lk)
            s = np.where(band.tile(np, 0, lq, 0, lk), s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)  # a fully masked row: no key at all
        p = np.exp(s - m)
        total = p.sum(axis=-1, keepdims=True)
        weights = p / np.where(total == 0, 1.0, total)
        with np.errstate(divide="ignore"):  # log(0) = -inf on fully masked rows
            lse = (m + np.log(total))[..., 0] if inputs.return_lse else None
        out = np.einsum("...qk,...kd->...qd", weights, v).astype(q.dtype)
        return out, lse, None
