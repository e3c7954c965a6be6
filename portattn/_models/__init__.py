"""What the model-level modules share (:mod:`portattn.multihead`,
:mod:`portattn.kv_cache`, :mod:`portattn.linear`, the paged modules and
:mod:`portattn.flash_attn`): the checks of a layer's weights and inputs. Models go
through the public call and never choose kernels themselves.
"""

from __future__ import annotations

from . import _flash_args as flash_args
from ._checks import (
    BIASES,
    WEIGHTS,
    Dims,
    check_features,
    check_same,
    count,
    dimensions,
    host_ints,
    int_at_least,
    integer_array,
    namespace_of,
)

__all__ = ["BIASES", "WEIGHTS", "Dims", "check_features", "check_same", "count", "dimensions",
           "flash_args", "host_ints", "int_at_least", "integer_array", "namespace_of"]
