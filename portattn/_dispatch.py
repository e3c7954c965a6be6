"""Choosing the kernel for a call, and explaining the choice."""

from __future__ import annotations

import contextlib
import logging
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._registry import (
    KNOWN_PLUGINS,
    KernelEntry,
    availability,
    forced_by_environment,
    kernel_entries,
)
from .errors import KernelNotUsableError, KernelOutputError, NoKernelError, UnknownKernelError
from .kernel import ANY

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ._inputs import AttentionInputs

__all__ = ["Plan", "check_result", "choose", "disable_kernels", "plan", "use_kernel"]

logger = logging.getLogger("portattn")

_forced: ContextVar[str | None] = ContextVar("portattn_forced_kernel", default=None)
_disabled: ContextVar[frozenset[str]] = ContextVar("portattn_disabled", default=frozenset())


_active = [0]
"""How many override blocks are open, in any thread: while none is, the context
variables need not be read (torch.compile cannot trace ``ContextVar.get``)."""


@contextlib.contextmanager
def use_kernel(name: str | None) -> Iterator[None]:
    """Within the block, every call runs kernel ``name`` (like ``kernel=name``)."""
    token = _forced.set(name)
    _active[0] += 1
    try:
        yield
    finally:
        _active[0] -= 1
        _forced.reset(token)


@contextlib.contextmanager
def disable_kernels(*names: str) -> Iterator[None]:
    """Within the block, dispatch skips the named kernels."""
    token = _disabled.set(_disabled.get() | frozenset(names))
    _active[0] += 1
    try:
        yield
    finally:
        _active[0] -= 1
        _disabled.reset(token)


_NO_OVERRIDES: tuple[str | None, frozenset[str]] = (None, frozenset())


def current_overrides() -> tuple[str | None, frozenset[str]]:
    """The kernel forced and the kernels disabled by the context managers, now."""
    if not _active[0]:
        return _NO_OVERRIDES
    return _forced.get(), _disabled.get()


def reasons(entry: KernelEntry, inputs: AttentionInputs) -> list[str]:
    """Why ``entry`` cannot run ``inputs``; empty when it can."""
    if entry.kernel is None:
        return [entry.status or "unavailable"]
    if _targets(entry, inputs):
        return _targeted_reasons(entry, inputs)
    # Availability may import the kernel's library: only kernels that target the call's
    # library and device (whose library is then already imported) are asked for it.
    if entry.name in current_overrides()[1]:
        return ["disabled by portattn.disable_kernels()"]
    return entry.kernel.not_supported_reasons(inputs)


def _targeted_reasons(entry: KernelEntry, inputs: AttentionInputs) -> list[str]:
    """:func:`reasons` for a loaded kernel known to target the call's library/device."""
    if entry.name in current_overrides()[1]:
        return ["disabled by portattn.disable_kernels()"]
    why = availability(entry)
    if why is not None:
        return [f"unavailable: {why}"]
    return entry.kernel.not_supported_reasons(inputs)


@dataclass(frozen=True)
class Plan:
    """What dispatch would do for one call; ``str(plan)`` reads like a report."""

    kernel: KernelEntry | None
    candidates: tuple[tuple[KernelEntry, tuple[str, ...]], ...]
    inputs: AttentionInputs
    forced: str | None = None

    def __str__(self) -> str:
        if self.kernel is not None:
            head = f"kernel: {self.kernel}" + (f" (forced: {self.forced})" if self.forced else "")
        else:
            head = "kernel: none can run these inputs"
        lines = [head, "inputs:", self.inputs.block(), "kernels, in priority order:"]
        for entry, why in self.candidates:
            verdict = "chosen" if entry is self.kernel else "; ".join(why) or "can run"
            lines.append(f"    {entry}: {verdict}")
        return "\n".join(lines)


def plan(inputs: AttentionInputs, kernel: str | None = None) -> Plan:
    """Evaluate every kernel against ``inputs`` without running any."""
    forced = _forced_name(kernel)
    entries = kernel_entries()
    candidates = tuple((e, tuple(reasons(e, inputs))) for e in entries)
    if forced is not None:
        chosen = [e for e, why in candidates if e.name == forced and not why]
    else:
        chosen = [e for e, why in candidates if not why]
    return Plan(chosen[0] if chosen else None, candidates, inputs, forced)


def choose(inputs: AttentionInputs, kernel: str | None = None) -> KernelEntry:
    """The kernel that runs ``inputs``: the forced one, else the first that can."""
    forced = _forced_name(kernel)
    entries = kernel_entries()
    if forced is not None:
        entry = _lookup(entries, forced)
        why = reasons(entry, inputs)
        if why:
            msg = (f"kernel {forced!r} cannot run attention with these inputs:\n"
                   f"{inputs.block()}\nbecause:\n" + "\n".join(f"    {w}" for w in why))
            raise KernelNotUsableError(msg)
    else:
        entry = next((e for e in _targeting(entries, inputs)
                      if not _targeted_reasons(e, inputs)), None)
        if entry is None:
            raise NoKernelError(_nothing_fits(entries, inputs))
    if not _compiling() and logger.isEnabledFor(logging.DEBUG):
        logger.debug("attention: %s@%s", entry.name, entry.version)
    return entry


_targeting_cache: dict[tuple[int, str, str], tuple[list[KernelEntry], list[KernelEntry]]] = {}


def _targeting(entries: list[KernelEntry], inputs: AttentionInputs) -> list[KernelEntry]:
    """The entries that target the call's library and device, in order (remembered per
    registry snapshot, library and device)."""
    key = (id(entries), inputs.namespace, inputs.device)
    cached = _targeting_cache.get(key)
    if cached is None or cached[0] is not entries:
        cached = _targeting_cache[key] = (entries, [e for e in entries if _targets(e, inputs)])
    return cached[1]


def _targets(entry: KernelEntry, inputs: AttentionInputs) -> bool:
    """Cheap pre-filter on the declared namespaces and devices: most kernels target
    another library, and asking them for every reason would cost each call."""
    kernel = entry.kernel
    if kernel is None:
        return False
    return ((kernel.namespaces == ANY or inputs.namespace in kernel.namespaces)
            and (kernel.devices == ANY or inputs.device in kernel.devices))


def _compiling() -> bool:
    """Inside torch.compile's tracing (which cannot trace logging calls)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _forced_name(kernel: str | None) -> str | None:
    return kernel or current_overrides()[0] or forced_by_environment()


def _lookup(entries: list[KernelEntry], name: str) -> KernelEntry:
    for entry in entries:
        if entry.name == name:
            return entry
    installed = ", ".join(sorted(e.name for e in entries))
    msg = f"unknown kernel {name!r}; installed kernels: {installed}"
    if name in KNOWN_PLUGINS:
        msg += f"\n{name} comes with `pip install {KNOWN_PLUGINS[name]}`"
    raise UnknownKernelError(msg)


def _nothing_fits(entries: list[KernelEntry], inputs: AttentionInputs) -> str:
    lines = ["no kernel can run attention with these inputs:", inputs.block(),
             "kernels tried, in priority order:"]
    lines += [f"    {e}: {'; '.join(reasons(e, inputs))}" for e in entries]
    lines.append("run `python -m portattn info` to see every installed kernel")
    return "\n".join(lines)


def check_result(entry: KernelEntry, inputs: AttentionInputs, out: Any, lse: Any,
                 weights: Any) -> None:
    """What dispatch checks of every kernel's answer: the shapes and dtypes it promised
    (values are the conformance kit's business). Cheap: no data is read."""
    lead = (*inputs.batch_shape, inputs.num_heads, inputs.q_len)
    wanted = [("out", out, (*lead, inputs.value_head_dim), inputs.query.dtype)]
    if inputs.return_lse:
        wanted.append(("lse", lse, lead, inputs.compute_dtype))
    if inputs.return_weights:
        wanted.append(("weights", weights, (*lead, inputs.kv_len), inputs.query.dtype))
    for what, array, shape, dtype in wanted:
        problem = None
        if array is None or not hasattr(array, "shape"):
            problem = f"no {what} array (got {type(array).__name__})"
        elif tuple(array.shape) != shape:
            problem = f"{what}.shape={tuple(array.shape)}, expected {shape}"
        elif dtype is not None and array.dtype != dtype:
            problem = f"{what}.dtype={array.dtype}, expected {dtype}"
        if problem is not None:
            msg = (f"kernel {entry} returned a wrong result: {problem}; run it again with "
                   "another kernel= and report the defect to its distribution")
            raise KernelOutputError(msg)
