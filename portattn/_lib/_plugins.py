"""What plugins add for an array library, looked up once per library.

A plugin names a library's module and an object (usually a module) in the entry-point
group ``portattn.libraries``::

    [project.entry-points."portattn.libraries"]
    torch = "portattn_torch._library"

whose attributes, each optional, are that library's parts:

- ``attach_autograd(inputs) -> (out, lse)``: the tiled kernel's forward recorded so
  the library's autograd differentiates it with the portable flash backward
  (:mod:`portattn.autograd`);
- ``seeds``: dropout's seeds (:mod:`portattn.dropout`): an object with ``draw(like)``
  and/or ``words(seed)``;
- ``distributed``: the engine of :mod:`portattn.distributed` (see
  :mod:`portattn.distributed.engine`);
- ``on_import()``: run once, before the first mask built while the library is
  imported (JAX: registers masks as pytrees), whether or not any kernel was loaded;
- ``vjp(fn, primals, cotangent) -> grads``: the gradient of ``sum(fn(*primals) *
  cotangent)`` with respect to each primal, by the library's autodiff (the
  derivatives of a score function the user wrote, :mod:`portattn.scores`).

Plugins written before this group registered each part in a group of its own
(``portattn.autograd``, ``portattn.seeds``, ``portattn.distributed``, and
``portattn.masks`` for ``on_import``); those groups are still read, for a library
with no ``portattn.libraries`` entry. Kernels have their group, ``portattn.kernels``.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from ..errors import PluginWarning
from ._probes import torch_compiling

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["GROUP", "OLD_GROUPS", "LibraryParts", "attach_for", "engine_for",
           "load_for_imported", "parts_for", "run_import_hooks", "seeds_for", "vjp_for"]

GROUP = "portattn.libraries"
OLD_GROUPS = {"attach_autograd": "portattn.autograd", "seeds": "portattn.seeds",
              "distributed": "portattn.distributed", "on_import": "portattn.masks"}
"""The group each part had before :data:`GROUP`, still read for a release."""


@dataclass(frozen=True)
class LibraryParts:
    """What the plugins add for one library; None for a part nobody adds."""

    attach_autograd: Callable[..., tuple[Any, Any]] | None = None
    seeds: Any = None
    distributed: Any = None
    on_import: Callable[[], Any] | None = None
    vjp: Callable[..., tuple[Any, ...]] | None = None


#: What each library's failure to load leaves it without (the warning says so).
_INSTEAD = {
    "attach_autograd": "gradients of the tiled kernel on {0} are recorded tile by tile",
    "seeds": "dropout on {0} takes integer seeds only",
    "distributed": "portattn.distributed takes only a LocalGroup for {0}",
    "on_import": "masks are not prepared for {0}",
    "vjp": "score functions on {0} have no gradients",
}

_parts: dict[str, LibraryParts] = {}
_lock = threading.Lock()
_hooked: set[str] = set()
"""Libraries whose ``on_import`` ran (or was found missing)."""


def parts_for(namespace: str) -> LibraryParts:
    """What plugins add for the library ``namespace`` (``"torch"``, ``"jax"``, ...).

    Looked up on the first call for a library; later calls are a plain dict lookup,
    which ``torch.compile`` traces without a graph break. A plugin that fails to load
    becomes a :class:`~portattn.errors.PluginWarning` and the parts it would add are
    None.

    Example:
        >>> from portattn._lib import parts_for
        >>> parts_for("numpy").attach_autograd is None  # NumPy has no autograd to wire
        True
    """
    found = _parts.get(namespace)
    if found is None:
        with _lock:
            found = _parts.get(namespace)
            if found is None:
                found = _parts[namespace] = _load(namespace)
    return found


def attach_for(namespace: str) -> Callable[..., tuple[Any, Any]] | None:
    """The autograd wiring the plugins add for ``namespace``, or None."""
    return parts_for(namespace).attach_autograd


def seeds_for(namespace: str) -> Any:
    """Dropout's seeds for ``namespace``, or None: an object with ``draw(like)``, an
    integer array drawn from the library's own generator for calls given no seed,
    and/or ``words(seed)``, given every array seed: the library's own kind of seed (a
    typed JAX key) as an integer array, or one the core cannot split into words with
    the library's operations (torch's unsigned tensors) as an integer array of the
    same value; other seeds as they are."""
    return parts_for(namespace).seeds


def engine_for(namespace: str) -> Any:
    """The :mod:`portattn.distributed` engine for ``namespace``, or None."""
    return parts_for(namespace).distributed


def vjp_for(namespace: str) -> Callable[..., tuple[Any, ...]] | None:
    """The vector-Jacobian product of ``namespace``'s autodiff, or None."""
    return parts_for(namespace).vjp


def load_for_imported() -> None:
    """Look up the parts of every library imported now (kernel discovery calls this): a
    call later traced by torch.compile then finds them with a dict lookup, since
    dynamo cannot follow the entry-point lookup."""
    for name in _libraries():
        if name not in _parts and _imported(name):
            parts_for(name)


def run_import_hooks() -> None:
    """Run the ``on_import`` of every library imported now whose hook has not run yet
    (mask constructors call this first). Not while torch.compile traces: its graphs
    hold no other library's arrays, and it cannot trace the lookup or the lock; the
    next mask built outside runs them."""
    if torch_compiling():
        return
    for name in _libraries():
        if name in _hooked or not _imported(name):
            continue
        with _lock:  # masks built in several threads at once: one runs it
            if name in _hooked:
                continue
            _hooked.add(name)
        hook = parts_for(name).on_import
        if hook is not None:
            try:
                hook()
            except Exception as e:  # a broken plugin must not stop masks being built
                warnings.warn(f"{GROUP}: on_import of {name} failed: "
                              f"{type(e).__name__}: {e}", PluginWarning, stacklevel=3)


_names: tuple[str, ...] | None = None


def _libraries() -> tuple[str, ...]:
    """Every library some plugin adds parts for (read once)."""
    global _names
    if _names is None:
        groups = (GROUP, *OLD_GROUPS.values())
        _names = tuple(dict.fromkeys(ep.name for g in groups for ep in entry_points(group=g)))
    return _names


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported, and not still being imported by another
    thread (a plugin loaded then would fail, and be remembered as broken)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return spec is not None and not getattr(spec, "_initializing", False)


def _load(namespace: str) -> LibraryParts:
    entries = [ep for ep in entry_points(group=GROUP) if ep.name == namespace]
    if entries:
        found = _loaded(entries[0], ", ".join(_INSTEAD.values()).format(namespace))
        return LibraryParts(**{part: getattr(found, part, None) for part in _INSTEAD})
    parts = {}
    for part, group in OLD_GROUPS.items():
        entries = [ep for ep in entry_points(group=group) if ep.name == namespace]
        if entries:
            parts[part] = _loaded(entries[0], _INSTEAD[part].format(namespace))
    return LibraryParts(**parts)


def _loaded(ep: Any, instead: str) -> Any:
    try:
        return ep.load()
    except Exception as e:  # a broken plugin must not break the call
        msg = (f"portattn: {ep.group} {ep.name} = {ep.value!r} could not be loaded "
               f"({type(e).__name__}: {e}); {instead}")
        warnings.warn(msg, PluginWarning, stacklevel=5)
        return None
