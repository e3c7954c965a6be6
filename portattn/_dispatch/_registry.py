"""Kernel discovery through the ``portattn.kernels`` entry-point group.

A short pipeline of small functions: collect -> drop disabled -> load -> validate ->
resolve duplicates -> order. Loading is lazy (first dispatch or ``kernels()``) and
cached; ``refresh_kernels()`` starts over. The environment variables are read with
the entry points (once, not per call) and again by ``refresh_kernels()``. A plugin
that fails never breaks a call: it becomes a warning and an entry whose ``status``
says why.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from .._lib import load_for_imported
from ..errors import PluginWarning
from ..kernel import Kernel

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["GROUP", "KernelEntry", "availability", "kernels", "refresh_kernels"]

GROUP = "portattn.kernels"
CORE = "portattn"
DISABLE_ENV = "PORTATTN_DISABLE_KERNELS"
FORCE_ENV = "PORTATTN_KERNEL"

#: Kernels provided by portattn's own plugin distributions, for install hints when one
#: is not installed (so not known from entry points); a test keeps it equal to the
#: plugins' declared entry points.
KNOWN_PLUGINS = {
    "numpy_fast": "portattn-numpy",
    "torch_sdpa": "portattn-torch",
    "torch_sdpa_dlpack": "portattn-torch",
    "torch_flex": "portattn-torch",
    "torch_sdpa_segments": "portattn-torch",
    "torch_sdpa_local": "portattn-torch",
    "triton_flash": "portattn-triton",
    "jax_dpa": "portattn-jax",
    "jax_flash": "portattn-jax",
    "dask_blockwise": "portattn-dask",
}


@dataclass(frozen=True)
class KernelEntry:
    """One installed kernel and where it came from, as :func:`kernels` lists it.

    ``name`` is the entry point's name, ``kernel`` an instance of the
    :class:`~portattn.kernel.Kernel` subclass (None when the plugin could not be
    loaded or was disabled by ``PORTATTN_DISABLE_KERNELS``), ``distribution`` and
    ``version`` the distribution that provides it. ``str(entry)`` reads
    ``name (distribution version)``, as in errors and :func:`explain`.

    Example:
        >>> import portattn
        >>> entry = next(e for e in portattn.kernels() if e.name == "tiled")
        >>> entry.distribution, entry.kernel.name, entry.status
        ('portattn', 'tiled', None)
        >>> entry.priority == entry.kernel.priority
        True
    """

    name: str
    kernel: Kernel | None
    distribution: str
    version: str
    status: str | None = None
    """None when loaded; otherwise why the kernel cannot be used at all."""

    @property
    def priority(self) -> int:
        """The kernel's priority; the lowest possible one when it is not loaded."""
        return self.kernel.priority if self.kernel is not None else -(2**31)

    @property
    def provenance(self) -> str:
        """``"distribution version"``, e.g. ``"portattn-numpy 0.1.0"``."""
        return f"{self.distribution} {self.version}"

    def __str__(self) -> str:
        return f"{self.name} ({self.provenance})"


def availability(entry: KernelEntry) -> str | None:
    """Why a loaded kernel cannot run here at all (None: it can). A plugin whose
    ``check_available`` raises is unavailable, with a warning, like one that fails to
    import; the answer is remembered like any other."""
    kernel = entry.kernel
    if kernel is None:
        return entry.status or "unavailable"
    try:
        return kernel.available()
    except (Exception, SystemExit) as e:
        why = f"check_available raised {type(e).__name__}: {e}"
        type(kernel)._availability = why  # the cache Kernel.available() keeps
        warnings.warn(f"portattn kernel {entry.name!r} from {entry.provenance}: "
                      f"unavailable: {why}", PluginWarning, stacklevel=2)
        return why


def collect(group: str = GROUP) -> list[EntryPoint]:
    return list(entry_points(group=group))


def disabled_names() -> frozenset[str]:
    value = os.environ.get(DISABLE_ENV, "")
    return frozenset(n.strip() for n in value.split(",") if n.strip())


def _origin(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown", "?"
    return dist.metadata["Name"] or "unknown", dist.version or "?"


def drop_disabled(eps: Iterable[EntryPoint], disabled: frozenset[str]
                  ) -> tuple[list[EntryPoint], list[KernelEntry]]:
    """Disabled plugins are never imported, so disabling works around a broken one."""
    kept, dropped = [], []
    for ep in eps:
        if ep.name in disabled:
            dist, version = _origin(ep)
            dropped.append(KernelEntry(ep.name, None, dist, version,
                                       f"disabled by {DISABLE_ENV}"))
        else:
            kept.append(ep)
    return kept, dropped


def load(ep: EntryPoint) -> KernelEntry:
    dist, version = _origin(ep)
    try:
        obj = ep.load()
    except (Exception, SystemExit) as e:  # a plugin's exit() must not end the caller
        status = f"unavailable: failed to import {ep.value}: {type(e).__name__}: {e}"
        warnings.warn(f"portattn kernel {ep.name!r} from {dist} {version}: {status}",
                      PluginWarning, stacklevel=2)
        return KernelEntry(ep.name, None, dist, version, status)
    return validate(ep.name, obj, dist, version)


def validate(name: str, obj: object, dist: str, version: str) -> KernelEntry:
    problem = None
    if not (isinstance(obj, type) and issubclass(obj, Kernel)):
        problem = f"{obj!r} is not a portattn.kernel.Kernel subclass"
    elif obj.name != name:
        problem = f"class declares name={obj.name!r} but is registered as {name!r}"
    if problem is not None:
        status = f"unavailable: {problem}"
        warnings.warn(f"portattn kernel {name!r} from {dist} {version}: {status}",
                      PluginWarning, stacklevel=2)
        return KernelEntry(name, None, dist, version, status)
    return KernelEntry(name, obj(), dist, version)


def resolve_duplicates(entries: Iterable[KernelEntry]) -> list[KernelEntry]:
    """One entry per name. Rule: portattn's own kernels win; then a loaded entry over a
    broken one; then higher priority; then the distribution name that sorts first."""
    def rank(e: KernelEntry) -> tuple:
        return (e.distribution != CORE, e.kernel is None, -e.priority, e.distribution)

    best: dict[str, KernelEntry] = {}
    for entry in sorted(entries, key=rank):
        kept = best.setdefault(entry.name, entry)
        if kept is not entry:
            warnings.warn(
                f"portattn kernel {entry.name!r} is provided by both {kept.provenance} and "
                f"{entry.provenance}; using {kept.provenance}", PluginWarning, stacklevel=2)
    return list(best.values())


def order(entries: Iterable[KernelEntry]) -> list[KernelEntry]:
    return sorted(entries, key=lambda e: (-e.priority, e.name))


def builtin_entries() -> list[KernelEntry]:
    from .._kernels import ReferenceKernel, TiledKernel
    from .._lib import VERSION as __version__

    return [KernelEntry(k.name, k(), CORE, __version__) for k in (ReferenceKernel, TiledKernel)]


def discover(eps: Iterable[EntryPoint] | None = None,
             disabled: frozenset[str] | None = None) -> list[KernelEntry]:
    """Run the whole pipeline (entry points default to the installed ones)."""
    disabled = disabled_names() if disabled is None else disabled
    kept, dropped = drop_disabled(collect() if eps is None else eps, disabled)
    builtins = [e if e.name not in disabled else
                KernelEntry(e.name, None, e.distribution, e.version, f"disabled by {DISABLE_ENV}")
                for e in builtin_entries()]
    loaded = [load(ep) for ep in kept]
    return order(resolve_duplicates([*builtins, *loaded, *dropped]))


_discovered: tuple[list[KernelEntry], str | None] | None = None
"""The installed kernels and the kernel forced by the environment, read together."""


def _discover_once() -> tuple[list[KernelEntry], str | None]:
    global _discovered
    if _discovered is None:
        _discovered = (discover(), os.environ.get(FORCE_ENV) or None)
        load_for_imported()
    return _discovered


def kernel_entries() -> list[KernelEntry]:
    """Installed kernels in dispatch order (cached)."""
    return (_discovered or _discover_once())[0]


def forced_by_environment() -> str | None:
    """The kernel named by ``PORTATTN_KERNEL`` when the kernels were discovered."""
    return (_discovered or _discover_once())[1]


def kernels() -> list[KernelEntry]:
    """Every installed kernel, in dispatch order, with distribution and version.

    The entry points of the group ``portattn.kernels`` are read once, on first use
    (this function or the first dispatch); :func:`refresh_kernels` reads them again.
    Kernels that failed to load or are disabled stay in the list, with a ``status``
    that says why.

    Returns:
        A new list of :class:`KernelEntry`, highest priority first (ties by name).

    Example:
        >>> import portattn
        >>> entries = portattn.kernels()
        >>> {"reference", "tiled"} <= {e.name for e in entries}
        True
        >>> priorities = [e.priority for e in entries]
        >>> priorities == sorted(priorities, reverse=True)
        True
    """
    return list(kernel_entries())


def refresh_kernels() -> list[KernelEntry]:
    """Forget what was discovered; read the entry points and the environment again.

    Use it after installing a plugin, or after changing ``PORTATTN_KERNEL`` or
    ``PORTATTN_DISABLE_KERNELS``, in a running process. Each kernel's availability
    is checked again too.

    Returns:
        The kernels found now, as :func:`kernels` returns them.

    Example:
        >>> import os
        >>> from unittest import mock
        >>> import portattn
        >>> with mock.patch.dict(os.environ, {"PORTATTN_DISABLE_KERNELS": "tiled"}):
        ...     entries = portattn.refresh_kernels()
        >>> [e.status for e in entries if e.name == "tiled"]
        ['disabled by PORTATTN_DISABLE_KERNELS']
        >>> [e.status for e in portattn.refresh_kernels() if e.name == "tiled"]
        [None]
    """
    global _discovered
    for entry in _discovered[0] if _discovered else ():
        if entry.kernel is not None and "_availability" in type(entry.kernel).__dict__:
            del type(entry.kernel)._availability  # check availability again too
    _discovered = None
    return kernels()
