"""A whole kernel plugin: NumPy einsum attention without masks."""

import numpy as np

from portattn.kernel import Kernel


class EinsumKernel(Kernel):
    name = "example_einsum"  # the entry-point name
    namespaces = frozenset({"numpy"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({"float32", "float64"})
    returns_lse = True
    priority = 5  # below the built-in tiled kernel: runs when asked for by name
    calls = 0

    def run(self, inputs):
        type(self).calls += 1
        q, k, v = inputs.query, inputs.key, inputs.value
        s = np.einsum("...qd,...kd->...qk", q, k) * inputs.scale
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        total = p.sum(axis=-1, keepdims=True)
        out = np.einsum("...qk,...kd->...qd", p / total, v).astype(q.dtype)
        lse = (m + np.log(total))[..., 0] if inputs.return_lse else None
        return out, lse, None
