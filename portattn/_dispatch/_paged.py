"""Which kernel runs a paged call: the first installed kernel, in dispatch order, that
declares paged calls and takes this one, unless it defers to another that takes it
too; None leaves it to the portable loop.
:class:`PagedPlan` says so, with every kernel's reasons (:func:`portattn.explain_paged`)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from ._registry import availability, kernel_entries
from ._select import PASSED_OVER, current_overrides

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .._inputs import PagedInputs
    from ..kernel import Kernel
    from ._registry import KernelEntry

__all__ = ["PagedPlan", "paged_kernel", "paged_plan"]

PORTABLE_LOOP = "the portable loop (every library and device: pages read a chunk at a time)"


@dataclass(frozen=True)
class PagedPlan:
    """What :func:`portattn.paged_attention` would do for one call.

    ``kernel`` is the chosen kernel's entry (None: the portable loop runs the call),
    ``candidates`` every kernel in dispatch order with the reasons it cannot run the
    call (empty for the chosen one and any after it that could), ``call`` the
    checked :class:`~portattn.kernel.PagedInputs`, ``cascade`` what ``cascade=True``
    would share. ``str(plan)`` reads like a report."""

    kernel: KernelEntry | None
    candidates: tuple[tuple[KernelEntry, tuple[str, ...]], ...]
    call: PagedInputs
    cascade: str

    def __str__(self) -> str:
        call = self.call
        hq, d = call.query.shape[1], call.query.shape[2]
        layout = "(P, Hkv, page, D)" if call.head_major else "(P, page, Hkv, D)"
        lines = [f"kernel: {self.kernel if self.kernel is not None else PORTABLE_LOOP}",
                 "call:",
                 f"    {_sequences(call)}",
                 f"    pools {tuple(call.key_pages.shape)} {layout}, page {call.page_size}, "
                 f"Hq={hq}, Hkv={call.num_kv_heads}, D={d}, dtype={call.dtype}, "
                 f"{call.namespace} on {call.device}",
                 f"    mask={call.mask!r} scale={call.scale:g} softcap={call.softcap}"
                 + "".join(f" {n}" for n in ("alibi_slopes", "sinks")
                           if getattr(call, n) is not None),
                 f"    cascade=True would: {self.cascade}",
                 "kernels, in dispatch order:"]
        for entry, why in self.candidates:
            verdict = "chosen" if entry is self.kernel else "; ".join(why) or "can run"
            lines.append(f"    {entry}: {verdict}")
        return "\n".join(lines)


def _sequences(call: PagedInputs) -> str:
    """The sequences and queries of ``call``, as far as they can be read now."""
    if call.traced:
        return (f"{call.block_table.shape[0]} sequences, {call.query.shape[0]} queries; "
                f"{', '.join(call.traced_arguments)} traced: the query tiles are planned "
                f"on the device")
    starts, lengths = call.query_starts, call.key_lengths
    counts = [b - a for a, b in pairwise(starts)]
    decoding, more = sum(n == 1 for n in counts), sum(n > 1 for n in counts)
    return (f"{len(counts)} sequences, {starts[-1]} queries ({decoding} decoding one token, "
            f"{more} with more, {len(counts) - decoding - more} with none), keys per "
            f"sequence {min(lengths, default=0)} to {max(lengths, default=0)}")


def _asked(call: PagedInputs) -> Iterator[tuple[KernelEntry, tuple[str, ...]]]:
    """Each kernel, in dispatch order, with why it cannot run ``call`` (empty: it can);
    asked lazily, so the first that can ends a caller's search."""
    _, disabled = current_overrides()
    for entry in kernel_entries():
        kernel = entry.kernel
        if kernel is None:
            yield entry, (entry.status or "unavailable",)
        elif entry.name in disabled:
            yield entry, ("disabled by portattn.disable_kernels()",)
        else:
            # the declarations first: availability may import the kernel's library
            why = tuple(kernel.paged_reasons(call))
            if not why:
                unavailable = availability(entry)
                why = () if unavailable is None else (f"unavailable: {unavailable}",)
            yield entry, why


def paged_kernel(call: PagedInputs) -> Kernel | None:
    """The kernel that runs ``call``; None for the portable loop. Kernels disabled by
    :func:`portattn.disable_kernels` or ``PORTATTN_DISABLE_KERNELS`` are skipped."""
    chosen, _ = _choose(call, every=False)
    return None if chosen is None else chosen.kernel


def paged_plan(call: PagedInputs, cascade: str) -> PagedPlan:
    """The :class:`PagedPlan` of ``call``; ``cascade`` says what ``cascade=True`` shares."""
    return PagedPlan(*_choose(call, every=True), call, cascade)


def _choose(call: PagedInputs, every: bool) -> tuple[
        KernelEntry | None, tuple[tuple[KernelEntry, tuple[str, ...]], ...]]:
    """The first kernel that can run ``call``, or a kernel it defers to that can
    (:meth:`~portattn.kernel.Kernel.paged_defers_to`), with the kernels asked (all of
    them with ``every``, else as few as the choice needs)."""
    candidates: list[tuple[KernelEntry, tuple[str, ...]]] = []
    chosen = deferring = None
    wanted: tuple[str, ...] = ()
    for entry, why in _asked(call):
        candidates.append((entry, why))
        if why:
            continue
        if chosen is None:
            chosen, wanted = entry, entry.kernel.paged_defers_to(call)
        elif deferring is None and entry.name in wanted:
            deferring, chosen = chosen, entry
        else:
            continue
        if not every and (deferring is not None or not wanted):
            break
    if deferring is not None:
        note = (f"{PASSED_OVER}defers to {chosen.name}",)
        candidates = [(e, note if e is deferring else why) for e, why in candidates]
    return chosen, tuple(candidates)
