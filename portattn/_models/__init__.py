"""What the model-level modules share (:mod:`portattn.multihead`,
:mod:`portattn.kv_cache`, :mod:`portattn.linear`): the checks of a layer's weights and
inputs. Models go through the public call and never choose kernels themselves.
"""

from __future__ import annotations

from ._checks import (
    BIASES,
    WEIGHTS,
    Dims,
    check_features,
    check_same,
    count,
    dimensions,
    namespace_of,
)

__all__ = ["BIASES", "WEIGHTS", "Dims", "check_features", "check_same", "count", "dimensions",
           "namespace_of"]
