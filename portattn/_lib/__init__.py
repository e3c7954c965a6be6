"""What the core knows of its surroundings, in one place: the array libraries, what
plugins add for them, and the settings tuned on this machine.

Detection and probes (which library, is torch.compile tracing, can values be read,
will autograd want gradients), names (a library's, a dtype's, a device's kind), host
copies and moves between libraries and devices, dropout's seeds as libraries hold
them, the lookup of what plugins add for a library (autograd wiring, seeds, the
distributed engine, what runs when a library is imported), and the slot through which
kernels read the settings ``python -m portattn tune`` chose.

No array library is imported here at import time: a library is probed through
``sys.modules`` and array-api-compat. It may import :mod:`portattn.errors` and nothing
else of portattn; every other room may import it.
"""

from __future__ import annotations

from ._arrays import (
    check_beside,
    device_class,
    device_kind,
    device_text,
    dtype_name,
    host_copy,
    host_values,
    in_native_order,
    is_native,
    namespace_name,
    own_copy,
)
from ._autodiff import vjp
from ._place import check_like, namespace, place, resolve_dtype, safe_device, to_host
from ._plugins import (
    GROUP,
    OLD_GROUPS,
    LibraryParts,
    attach_for,
    engine_for,
    load_for_imported,
    parts_for,
    run_import_hooks,
    seeds_for,
    vjp_for,
)
from ._probes import jax_tracer_type, needs_grad, torch_compiling, values_readable, without_grad
from ._seeds import MAX_WORDS, SEED_BITS, check_seed
from ._tuned import install as install_tuned_reader
from ._tuned import trying as trying_tuned
from ._tuned import value as tuned_value
from ._version import VERSION

__all__ = [
    "GROUP",
    "MAX_WORDS",
    "OLD_GROUPS",
    "SEED_BITS",
    "VERSION",
    "LibraryParts",
    "attach_for",
    "check_beside",
    "check_like",
    "check_seed",
    "device_class",
    "device_kind",
    "device_text",
    "dtype_name",
    "engine_for",
    "host_copy",
    "host_values",
    "in_native_order",
    "install_tuned_reader",
    "is_native",
    "jax_tracer_type",
    "load_for_imported",
    "namespace",
    "namespace_name",
    "needs_grad",
    "own_copy",
    "parts_for",
    "place",
    "resolve_dtype",
    "run_import_hooks",
    "safe_device",
    "seeds_for",
    "to_host",
    "torch_compiling",
    "trying_tuned",
    "tuned_value",
    "values_readable",
    "vjp",
    "vjp_for",
    "without_grad",
]
