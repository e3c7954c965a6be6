"""Shared prompts read once: cascade attention over pages.

Sequences forked from one prompt (samples, beams) begin with the same pages. Every
query of such a group attends those pages in one pass (the group's queries stacked as
the rows of one sequence), and each sequence's own pages in a second; the two halves
are exact attention over disjoint keys, joined by log-sum-exp (:func:`merge`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._inputs import PagedInputs
from ._merge import merge
from ._paged import attend_pages

if TYPE_CHECKING:
    from collections.abc import Callable


def attend_pages_cascading(call: PagedInputs,
                           attend: Callable[[PagedInputs], tuple[Any, Any]] = attend_pages
                           ) -> tuple[Any, Any]:
    """``attend(call)`` (a paged kernel's loop, or :func:`attend_pages`), with shared
    leading pages read once per group of sequences; the plain call where no group
    shares a page or the mask or ALiBi could hide a shared key from one of the group's
    queries."""
    groups = shared_prefixes(call)
    if not groups or call.alibi_slopes is not None or not _sees_all_before(call):
        return attend(call)
    xp, dev = call.xp, call.device_obj
    page = call.page_size
    table = [list(map(int, row)) for row in call.host_table]
    lengths = list(call.key_lengths)
    rows: list[int] = []  # the packed queries the shared pass computes, group by group
    starts, shared_table, shared_lengths = [0], [], []
    for members, pages in groups:
        for s in members:
            rows.extend(range(call.query_starts[s], call.query_starts[s + 1]))
            table[s] = table[s][pages:] + [-1] * pages  # the rest of the sequence
            lengths[s] -= pages * page
        starts.append(len(rows))
        shared_table.append(call.host_table[members[0]][:pages])
        shared_lengths.append(pages * page)

    def ints(values: Any) -> Any:
        return xp.asarray(values, dtype=xp.int32, device=dev)

    width = max(len(r) for r in shared_table)
    padded = [list(map(int, r)) + [-1] * (width - len(r)) for r in shared_table]
    # Every query of a group sees every shared key: no mask, no sinks (they join once,
    # in the second pass).
    shared = call._replace(
        query=xp.take(call.query, ints(rows), axis=0), block_table=ints(padded),
        host_table=padded, query_starts=starts, key_lengths=shared_lengths,
        key_counts=ints(shared_lengths), query_offsets=ints(starts), mask=None, sinks=None)
    rest = call._replace(block_table=ints(table), host_table=table, key_lengths=lengths,
                         key_counts=ints(lengths))
    out, lse = attend(rest)
    part, part_lse = attend(shared)
    # The shared pass's rows in the order of the call; rows it did not compute get the
    # lse of no key (weight 0 in the merge).
    total = call.query.shape[0]
    where = [len(rows)] * total
    for index, row in enumerate(rows):
        where[row] = index
    heads = call.query.shape[1]
    part = xp.concat([part, xp.zeros((1, *part.shape[1:]), dtype=part.dtype, device=dev)])
    part_lse = xp.concat([part_lse, xp.full((heads, 1), -math.inf, dtype=part_lse.dtype,
                                            device=dev)], axis=1)
    pick = ints(where)
    part = xp.take(part, pick, axis=0)
    part_lse = xp.permute_dims(xp.take(part_lse, pick, axis=1), (1, 0))
    merged, merged_lse = merge([out, part], [xp.permute_dims(lse, (1, 0)), part_lse])
    return merged, xp.permute_dims(merged_lse, (1, 0))


def cascade_summary(call: PagedInputs) -> str:
    """What ``cascade=True`` would share for ``call``, in words (for explain)."""
    if call.traced:
        return (f"nothing: {', '.join(call.traced_arguments)} traced (the shared pages "
                f"are found on the host)")
    groups = shared_prefixes(call)
    if not groups:
        return "nothing: no two sequences with queries begin with the same full pages"
    if call.alibi_slopes is not None:
        return "nothing: alibi_slopes (a shared key's score differs per sequence)"
    if not _sees_all_before(call):
        return f"nothing: mask={call.mask!r} may hide a shared key from a query"
    shared = [f"{pages} page{'' if pages == 1 else 's'} among sequences {members}"
              for members, pages in groups]
    return "read " + "; ".join(shared) + " once"


def shared_prefixes(call: PagedInputs) -> list[tuple[list[int], int]]:
    """Groups of two or more sequences whose tables begin with the same pages, as
    ``(sequences, pages)``: the shared pages are full and lie before every query of
    the group. No group where the table, lengths or starts cannot be read now (traced):
    the call then runs as without ``cascade``, to the same result."""
    if call.traced:
        return []
    page = call.page_size
    table = call.host_table
    by_first: dict[int, list[int]] = {}
    room: dict[int, int] = {}  # full pages before the sequence's first query
    for s, length in enumerate(call.key_lengths):
        n = call.query_starts[s + 1] - call.query_starts[s]
        room[s] = (length - n) // page
        if n and room[s]:
            by_first.setdefault(int(table[s][0]), []).append(s)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        most = min(room[s] for s in members)
        first = table[members[0]]
        pages = 0
        while pages < most and all(int(table[s][pages]) == int(first[pages])
                                   for s in members):
            pages += 1
        groups.append((members, pages))
    return groups


def _sees_all_before(call: PagedInputs) -> bool:
    """Whether every query sees every key before its sequence's first query: no mask,
    or a causal one."""
    from ..masks import causal

    return call.mask is None or call.mask == causal()
