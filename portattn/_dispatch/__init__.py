"""Which kernel runs a call: the registry of installed kernels (entry points, built-in
ones, disabled and forced ones), the choice and its report (:class:`Plan`,
``explain``), the kernel of a paged call, the overrides callers set, measurements
from ``python -m portattn tune`` and the decisions remembered per call signature.

It may import :mod:`portattn._kernels` (the built-in kernels), :mod:`portattn.kernel`,
:mod:`portattn._inputs`, :mod:`portattn.masks`, :mod:`portattn._lib` and
:mod:`portattn.errors`; never the public call or the models.
"""

from __future__ import annotations

from ._call_cache import described_and_chosen
from ._paged import PagedPlan, paged_kernel, paged_plan
from ._registry import (
    CORE,
    DISABLE_ENV,
    FORCE_ENV,
    KernelEntry,
    availability,
    forced_by_environment,
    kernels,
    refresh_kernels,
)
from ._select import (
    Plan,
    check_result,
    choose,
    compiling,
    current_overrides,
    disable_kernels,
    select,
    use_kernel,
)
from ._tune import (
    BAND_SIZES,
    FORMAT,
    TUNE_ENV,
    TuneWarning,
    default_path,
    installed_version,
    machine,
    refresh,
)

__all__ = ["BAND_SIZES", "CORE", "DISABLE_ENV", "FORCE_ENV", "FORMAT", "TUNE_ENV", "KernelEntry",
           "PagedPlan", "Plan", "TuneWarning", "availability", "check_result", "choose",
           "compiling", "current_overrides", "default_path", "described_and_chosen",
           "disable_kernels", "forced_by_environment", "installed_version", "kernels", "machine",
           "paged_kernel", "paged_plan", "refresh", "refresh_kernels", "select", "use_kernel"]
