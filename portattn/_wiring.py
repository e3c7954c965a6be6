"""Lookup of what plugins register per library: the autograd wiring (see
:mod:`portattn.autograd`), dropout's seeds (see :mod:`portattn.dropout`) and the
engine of :mod:`portattn.distributed`."""

from __future__ import annotations

import sys
import warnings
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .errors import PluginWarning

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._inputs import AttentionInputs

__all__ = ["DISTRIBUTED", "GROUP", "SEEDS", "attach_for", "engine_for", "load_for_imported",
           "seeds_for"]

GROUP = "portattn.autograd"
SEEDS = "portattn.seeds"
DISTRIBUTED = "portattn.distributed"


_attached: dict[str, Any] = {}
_seeds: dict[str, Any] = {}
_engines: dict[str, Any] = {}


def attach_for(namespace: str) -> Callable[[AttentionInputs], tuple[Any, Any]] | None:
    """The installed autograd wiring for ``namespace``, or None.

    The entry point is loaded on the first call for a namespace; later calls are a
    plain dict lookup, which ``torch.compile`` traces without a graph break.

    Args:
        namespace: the library's short name, as
            :attr:`AttentionInputs.namespace <portattn.kernel.AttentionInputs.namespace>`
            gives it (``"torch"``, ``"jax"``, ...).

    Returns:
        The callable ``attach(inputs) -> (out, lse)`` registered under that name in
        the entry-point group ``portattn.autograd``; None when no plugin registers
        one, or when it fails to load (with a
        :class:`~portattn.errors.PluginWarning`).

    Example:
        >>> from portattn.autograd import attach_for
        >>> attach_for("numpy") is None  # NumPy has no autograd to wire
        True
    """
    if namespace not in _attached:
        _attached[namespace] = _load(GROUP, namespace, "the autograd wiring", (
            f"gradients of the tiled kernel on {namespace} are recorded tile by tile "
            "instead"))
    return _attached[namespace]


def seeds_for(namespace: str) -> Any:
    """What a plugin registers for dropout's seeds on ``namespace`` (entry-point group
    ``portattn.seeds``), or None: an object (a module) with ``draw(like)``, an
    integer array drawn from the library's own generator for calls given no seed,
    and/or ``words(seed)``, given every array seed: the library's own kind of seed (a
    typed JAX key) as an integer array, or one the core cannot split into words with
    the library's operations (torch's unsigned tensors) as an integer array of the
    same value; other seeds as they are."""
    if namespace not in _seeds:
        _seeds[namespace] = _load(SEEDS, namespace, "the dropout seeds", (
            "dropout on it takes integer seeds only"))
    return _seeds[namespace]


def engine_for(namespace: str) -> Any:
    """The :mod:`portattn.distributed` engine a plugin registers for ``namespace``
    (entry-point group ``portattn.distributed``, see
    :mod:`portattn.distributed.engine`), or None."""
    if namespace not in _engines:
        _engines[namespace] = _load(DISTRIBUTED, namespace, "the distributed engine", (
            "portattn.distributed takes only a LocalGroup for it"))
    return _engines[namespace]


def load_for_imported() -> None:
    """Load what plugins register for every library imported now (kernel discovery
    calls this): a call later traced by torch.compile then finds it with a dict
    lookup, since dynamo cannot follow the entry-point lookup."""
    for group, loaded, lookup in ((GROUP, _attached, attach_for), (SEEDS, _seeds, seeds_for),
                                  (DISTRIBUTED, _engines, engine_for)):
        for ep in entry_points(group=group):
            if _imported(ep.name) and ep.name not in loaded:
                lookup(ep.name)


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported, and not still being imported by another
    thread (a plugin loaded then would fail, and be remembered as broken)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return spec is not None and not getattr(spec, "_initializing", False)


def _load(group: str, namespace: str, what: str, instead: str) -> Any:
    found = [ep for ep in entry_points(group=group) if ep.name == namespace]
    if not found:
        return None
    ep = found[0]
    try:
        return ep.load()
    except Exception as e:  # a broken plugin must not break the call
        msg = (f"portattn: {what} {ep.name} = {ep.value!r} could not be loaded "
               f"({type(e).__name__}: {e}); {instead}")
        warnings.warn(msg, PluginWarning, stacklevel=4)
        return None
