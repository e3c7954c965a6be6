"""The public call: :func:`attention`, :func:`explain` and torch's
:func:`scaled_dot_product_attention` signature, each a description of the call
(:mod:`portattn._inputs`), a kernel chosen for it (:mod:`portattn._dispatch`), the run,
and the checks of what came back.

It may import dispatch and everything below it; the models and the distributed
engines call it.
"""

from __future__ import annotations

from ._api import attention, explain, scaled_dot_product_attention

__all__ = ["attention", "explain", "scaled_dot_product_attention"]
