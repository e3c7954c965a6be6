"""Choosing the kernel for a call, and explaining the choice."""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._lib import torch_compiling
from ..errors import KernelNotUsableError, KernelOutputError, NoKernelError, UnknownKernelError
from ._evidence import evidence_choice, has_evidence
from ._registry import (
    KNOWN_PLUGINS,
    KernelEntry,
    availability,
    forced_by_environment,
    kernel_entries,
)
from ._tune import measured_choice, tuned

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .._inputs import AttentionInputs
    from ..kernel import Kernel

__all__ = ["Plan", "check_result", "choose", "compiling", "disable_kernels", "select",
           "use_kernel"]

logger = logging.getLogger("portattn")

_forced: ContextVar[str | None] = ContextVar("portattn_forced_kernel", default=None)
_disabled: ContextVar[frozenset[str]] = ContextVar("portattn_disabled", default=frozenset())


_open: list[None] = []
"""One entry per override block open in any thread (``list.append`` and ``pop`` are
atomic: no lock to leave held): while it is empty the context variables need not be
read (torch.compile cannot trace ``ContextVar.get``)."""


@contextlib.contextmanager
def _overriding(variable: ContextVar[Any], value: Any) -> Iterator[None]:
    """``variable`` set to ``value`` within the block. It is set inside the ``try`` and
    reset first on the way out, so an interruption (Ctrl-C) between two steps leaves at
    most an extra entry in :data:`_open` (a slower dispatch), not an override."""
    _open.append(None)
    token = None
    try:
        token = variable.set(value)
        yield
    finally:
        if token is not None:
            variable.reset(token)
        _open.pop()


def use_kernel(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, every call runs kernel ``name``, as if passed ``kernel=name``.

    A ``kernel=`` argument still wins over the block, and the block over the
    ``PORTATTN_KERNEL`` environment variable. The setting is a context variable: it
    holds for this thread (or task) and for the calls nested in the block.

    Args:
        name: the kernel's name, as :func:`kernels` lists it; None lifts the choice of
            an outer block (``PORTATTN_KERNEL`` then applies again).

    Returns:
        A context manager. Each call inside the block checks the name, and raises
        :class:`~portattn.errors.UnknownKernelError` when no kernel has it or
        :class:`~portattn.errors.KernelNotUsableError` when that kernel cannot run
        the call.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> with portattn.use_kernel("reference"):
        ...     plan = portattn.explain(q, q, q)
        >>> plan.kernel.name, plan.forced
        ('reference', 'reference')
    """
    return _overriding(_forced, name)


def disable_kernels(*names: str) -> contextlib.AbstractContextManager[None]:
    """Within the block, dispatch skips the named kernels.

    Nested blocks add to the kernels an outer block disabled. Unlike
    ``PORTATTN_DISABLE_KERNELS``, which keeps a plugin from being imported at all,
    the kernels stay loaded; :func:`explain` gives ``disabled by
    portattn.disable_kernels()`` as their reason. Names no kernel has are ignored.

    Args:
        *names: kernel names, as :func:`kernels` lists them.

    Returns:
        A context manager; the setting holds for this thread (or task) and for the
        calls nested in the block.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> with portattn.disable_kernels("tiled"):
        ...     plan = portattn.explain(q, q, q)
        >>> dict((entry.name, why) for entry, why in plan.candidates)["tiled"]
        ('disabled by portattn.disable_kernels()',)
        >>> plan.kernel.name != "tiled"
        True
    """
    return _overriding(_disabled, _disabled.get() | frozenset(names))


_NO_OVERRIDES: tuple[str | None, frozenset[str]] = (None, frozenset())


def current_overrides() -> tuple[str | None, frozenset[str]]:
    """The kernel forced and the kernels disabled by the context managers, now."""
    if not _open:
        return _NO_OVERRIDES
    return _forced.get(), _disabled.get()


def _reasons(entry: KernelEntry, inputs: AttentionInputs,
             disabled: frozenset[str]) -> list[str]:
    """Why ``entry`` cannot run ``inputs``; empty when it can."""
    kernel = entry.kernel
    if kernel is None:
        return [entry.status or "unavailable"]
    # A kernel for another library or device is refused on its declaration alone:
    # asking it anything else (its availability) may import its library.
    elsewhere = _elsewhere(kernel, inputs)
    if elsewhere:
        return list(elsewhere)
    if entry.name in disabled:
        return ["disabled by portattn.disable_kernels()"]
    why = availability(entry)
    if why is not None:
        return [f"unavailable: {why}"]
    try:
        return kernel.not_supported_reasons(inputs)
    except Exception as e:  # a broken plugin refuses, it does not break every call
        return [f"not_supported_reasons raised {type(e).__name__}: {e}"]


PASSED_OVER = "passed over: "
"""How :class:`Plan` shows a kernel's :meth:`~portattn.kernel.Kernel.dispatch_reasons`:
it could run the call, dispatch would rather another did."""


def _preferences(entry: KernelEntry, inputs: AttentionInputs) -> tuple[str, ...]:
    """Why dispatch passes over ``entry``, which can run ``inputs``; empty when it
    does not."""
    try:
        why = entry.kernel.dispatch_reasons(inputs)
    except Exception as e:  # a broken preference is no refusal
        why = [f"dispatch_reasons raised {type(e).__name__}: {e}"]
    return tuple(PASSED_OVER + w for w in why)


_elsewhere_reasons: dict[tuple[type, str, str], tuple[str, ...]] = {}


def _elsewhere(kernel: Kernel, inputs: AttentionInputs) -> tuple[str, ...]:
    """``kernel.target_reasons(inputs)``, remembered: it depends on the call's library
    and device kind alone, and most kernels target another library."""
    key = (type(kernel), inputs.namespace, inputs.device)
    why = _elsewhere_reasons.get(key)
    if why is None:
        why = _elsewhere_reasons[key] = tuple(kernel.target_reasons(inputs))
    return why


LOOKS_TRANSPOSED = 256
"""More heads than this, and than positions, looks like the length axis read as heads."""


def axes_read(inputs: AttentionInputs, layout: str) -> list[str]:
    """The lines of :class:`Plan`'s report that say which axes were read as what, and a
    hint when they look swapped: arrays in the other layout run without an error."""
    sizes = [f"batch={_batch_text(inputs.batch_shape)}"] if inputs.batch_shape else []
    sizes += [f"heads={inputs.num_heads}", f"length={inputs.q_len}",
              f"dim={inputs.head_dim}"]
    if inputs.num_kv_heads != inputs.num_heads:
        sizes.insert(-2, f"kv_heads={inputs.num_kv_heads}")
    if inputs.kv_len != inputs.q_len:
        sizes.insert(-1, f"kv_length={inputs.kv_len}")
    if inputs.value_head_dim != inputs.head_dim:
        sizes.append(f"value_dim={inputs.value_head_dim}")
    lines = [f"    read as ({', '.join(sizes)}) with layout={layout!r}"]
    if inputs.num_heads > max(inputs.q_len, LOOKS_TRANSPOSED):
        other, axes = (("blhd", "(..., length, heads, dim)") if layout == "bhld"
                       else ("bhld", "(..., heads, length, dim)"))
        lines.append(f"    hint: {inputs.num_heads} heads of length {inputs.q_len} look "
                     f"swapped; for {axes} arrays pass layout={other!r}")
    return lines


def _batch_text(shape: tuple[int, ...]) -> str:
    return str(shape[0]) if len(shape) == 1 else str(shape)


@dataclass(frozen=True)
class Plan:
    """What dispatch would do for one call, as :func:`explain` returns it.

    ``kernel`` is the chosen kernel's :class:`KernelEntry` (None when no kernel can
    run the call), ``candidates`` every kernel asked, in priority order, each with
    the reasons it cannot run the call (empty when it can; ``"passed over: ..."``
    when it can but dispatch prefers another, see
    :meth:`~portattn.kernel.Kernel.dispatch_reasons`), ``inputs`` the call's
    :class:`~portattn.kernel.AttentionInputs` and ``forced`` the kernel name forced
    by ``kernel=``, :func:`use_kernel` or ``PORTATTN_KERNEL`` (None when none was).
    ``str(plan)`` reads like a report of all of it.

    Example:
        >>> import numpy as np
        >>> import portattn
        >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
        >>> plan = portattn.explain(q, q, q, kernel="tiled")
        >>> plan.kernel.name, plan.forced, plan.inputs.q_len
        ('tiled', 'tiled', 8)
        >>> [why for entry, why in plan.candidates if entry.name == "tiled"]
        [()]
        >>> str(plan).splitlines()[0].endswith("(forced: tiled)")
        True
    """

    kernel: KernelEntry | None
    candidates: tuple[tuple[KernelEntry, tuple[str, ...]], ...]
    inputs: AttentionInputs
    forced: str | None = None
    note: str | None = None
    """Why ``kernel`` was preferred over other kernels that can run the call, if not
    for its priority (e.g. a measurement)."""
    layout: str = "bhld"
    """The caller's ``layout``: ``str(plan)`` says how it read the arrays' axes."""

    def __str__(self) -> str:
        if self.kernel is not None:
            head = f"kernel: {self.kernel}" + (f" (forced: {self.forced})" if self.forced else "")
        else:
            head = "kernel: none can run these inputs"
        lines = [head, "inputs:", self.inputs.block(), *axes_read(self.inputs, self.layout),
                 "kernels, in priority order:"]
        for entry, why in self.candidates:
            if entry is self.kernel:
                verdict = "chosen" + (f" ({self.note})" if self.note else "")
            else:
                verdict = "; ".join(why) or "can run"
            lines.append(f"    {entry}: {verdict}")
        lines += [f"note: {note}" for note in self.kernel_notes]
        return "\n".join(lines)

    @property
    def kernel_notes(self) -> tuple[str, ...]:
        """What the chosen kernel says a caller should know
        (:attr:`~portattn.kernel.Kernel.notes`)."""
        if self.kernel is None:
            return ()
        try:
            return tuple(self.kernel.kernel.notes(self.inputs))
        except Exception as e:  # a plugin's bug must not break explain()
            return (f"{self.kernel.name}.notes raised {type(e).__name__}: {e}",)

    def error(self) -> Exception:
        """What :func:`portattn.attention` raises when no kernel was chosen.

        Returns:
            A :class:`~portattn.errors.KernelNotUsableError` with the forced kernel's
            reasons when a kernel was forced, else a
            :class:`~portattn.errors.NoKernelError` listing every kernel's reasons.

        Example:
            >>> import numpy as np
            >>> import portattn
            >>> q = np.zeros((1, 2, 8, 4), dtype=np.float32)
            >>> plan = portattn.explain(q, q, q, return_weights=True, kernel="tiled")
            >>> error = plan.error()
            >>> type(error).__name__
            'KernelNotUsableError'
            >>> print(str(error).splitlines()[0])
            kernel 'tiled' cannot run attention with these inputs:
        """
        if self.forced is not None:
            why = next(w for e, w in self.candidates if e.name == self.forced)
            msg = (f"kernel {self.forced!r} cannot run attention with these inputs:\n"
                   f"{self.inputs.block()}\nbecause:\n" + "\n".join(f"    {w}" for w in why))
            return KernelNotUsableError(msg)
        lines = ["no kernel can run attention with these inputs:", self.inputs.block(),
                 "kernels tried, in priority order:"]
        lines += [f"    {e}: {'; '.join(why)}" for e, why in self.candidates]
        lines.append("run `python -m portattn info` to see every installed kernel")
        return NoKernelError("\n".join(lines))


def select(inputs: AttentionInputs, kernel: str | None = None, *,
           every: bool = True, nonfinite: str | None = None) -> Plan:
    """The one selection path of :func:`portattn.attention` and :func:`portattn.explain`.

    Kernels are asked in priority order; the forced kernel (``kernel=``,
    :func:`use_kernel`, ``PORTATTN_KERNEL``) runs if it can, else the measured fastest
    of the kernels that can and that no preference of theirs passes over
    (:meth:`~portattn.kernel.Kernel.dispatch_reasons`; ``python -m portattn tune`` on
    this machine, else the evidence the plugins ship), else the first of them that
    defers to none of the others (:meth:`~portattn.kernel.Kernel.defers_to`), else the
    first kernel passed over: a preference never leaves a call without a kernel, and
    a forced kernel is not asked for one. ``every=False`` stops at the first kernel
    that can run when no measurement or deferral could prefer another (what
    :func:`portattn.attention` needs); the kernels after it are then left out of
    ``Plan.candidates``. What is decided follows from the
    description of the call alone (the Kernel protocol), so it may be remembered;
    ``nonfinite`` (why a call's values break a kernel's ``finite_inputs_only``) also
    refuses those kernels.
    """
    forced = _forced_name(kernel)
    entries = kernel_entries()
    if forced is not None:
        _lookup(entries, forced)
    # a tracer reads no files
    measuring = forced is None and not compiling() and (tuned() or has_evidence(inputs))
    disabled = current_overrides()[1]
    candidates: list[tuple[KernelEntry, tuple[str, ...]]] = []
    runnable: list[KernelEntry] = []
    passed_over: list[KernelEntry] = []
    deferring: dict[str, tuple[str, ...]] = {}
    for entry in entries:
        if forced is not None and not every and entry.name != forced:
            continue
        why = tuple(_reasons(entry, inputs, disabled))
        if not why and nonfinite is not None and entry.kernel.finite_inputs_only:
            why = (f"exact on finite inputs only: {nonfinite}",)
        if not why and entry.name != forced:
            why = _preferences(entry, inputs)
            if why:
                passed_over.append(entry)
            elif forced is None:
                deferring[entry.name] = _deferrals(entry, inputs)
        candidates.append((entry, why))
        if not why:
            runnable.append(entry)
            if not (every or measuring or deferring.get(entry.name)):
                break
    runnable = _after_deferrals(runnable, deferring, candidates)
    chosen, note = (runnable[0] if runnable else None), None
    if forced is not None:
        chosen = next((e for e in runnable if e.name == forced), None)
    elif measuring and len(runnable) > 1:
        names = [e.name for e in runnable]
        measured = measured_choice(inputs, names) or evidence_choice(inputs, names, names[0])
        if measured is not None:
            chosen = next(e for e in runnable if e.name == measured[0])
            note = measured[1]
    elif chosen is None and passed_over:
        chosen = passed_over[0]
        note = "every kernel that can run the call is passed over; the first of them runs"
    return Plan(chosen, tuple(candidates), inputs, forced, note)


def _deferrals(entry: KernelEntry, inputs: AttentionInputs) -> tuple[str, ...]:
    try:
        return tuple(entry.kernel.defers_to(inputs))
    except Exception:  # a broken preference is no preference
        return ()


def _after_deferrals(runnable: list[KernelEntry], deferring: dict[str, tuple[str, ...]],
                     candidates: list[tuple[KernelEntry, tuple[str, ...]]]
                     ) -> list[KernelEntry]:
    """``runnable`` with the kernels that defer to another runnable kernel moved to the
    end (still runnable: a measurement may choose them), each then shown in
    ``candidates`` as passed over for the kernel it defers to."""
    names = {e.name for e in runnable}
    moved = {name: next(t for t in to if t in names)
             for name, to in deferring.items() if any(t in names for t in to)}
    if not moved or len(moved) == len(runnable):
        return runnable
    for i, (entry, _) in enumerate(candidates):
        if entry.name in moved:
            candidates[i] = (entry, (f"{PASSED_OVER}defers to {moved[entry.name]}, which "
                                     "can run the call, unless measured faster",))
    return ([e for e in runnable if e.name not in moved]
            + [e for e in runnable if e.name in moved])


def choose(inputs: AttentionInputs, kernel: str | None = None) -> KernelEntry:
    """The kernel that runs ``inputs``, or the error saying why none can."""
    plan = select(inputs, kernel, every=False)
    if plan.kernel is None:
        raise plan.error()
    if not compiling() and logger.isEnabledFor(logging.DEBUG):
        logger.debug("attention: %s@%s", plan.kernel.name, plan.kernel.version)
    return plan.kernel


def compiling() -> bool:
    """Inside torch.compile's tracing (which cannot trace logging calls)."""
    return torch_compiling()


def _forced_name(kernel: str | None) -> str | None:
    return kernel or current_overrides()[0] or forced_by_environment()


def _lookup(entries: list[KernelEntry], name: str) -> KernelEntry:
    for entry in entries:
        if entry.name == name:
            return entry
    installed = ", ".join(sorted(e.name for e in entries))
    msg = f"unknown kernel {name!r}; installed kernels: {installed}"
    if name in KNOWN_PLUGINS:
        plugin = KNOWN_PLUGINS[name]
        msg += (f"\n{name} comes with {plugin}: from portattn's source tree, "
                f"`pip install ./backends/{plugin}`")
    raise UnknownKernelError(msg)


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
