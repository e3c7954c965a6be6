"""The agreement before the schedule: every rank describes its call in a small record of
fixed size, the ranks exchange the records in one collective, and every rank checks
them all the same way, so they fail together with the same error or all start.

A record holds the shard shapes and dtypes, the whole sequence's lengths, the layout,
the strategy as chosen, ``scale``, ``softcap`` and a fingerprint of the mask, or, for
a rank whose own inputs were refused, ``"I failed: <its error>"``. The fingerprint is
a BLAKE2b digest of the mask's structure (plain parameters; a mask function by its
qualified name) and of the values its arrays hold, the same in every process
(Python's ``hash`` is not).
"""

from __future__ import annotations

import hashlib
import json
import numbers
from typing import TYPE_CHECKING, Any

from .._lib import dtype_name, host_copy
from ..masks import Mask, dense
from ._faults import failure_text

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._layout import Layout
    from ._plan import Problem

__all__ = ["RECORD_BYTES", "agree", "call_record", "decode", "encode", "mask_fingerprint",
           "settle"]

RECORD_BYTES = 4096
"""Bytes of every rank's record: a fixed size, so the exchange moves equal blocks."""

_MASK_TEXT = 240  # characters of a mask's repr kept in a record (its digest follows)


def mask_fingerprint(mask: Any) -> str:
    """A digest of ``mask`` (a :mod:`portattn.masks` mask, a boolean array or None)
    equal in every process for masks that allow the same pairs by the same
    parameters and values.

    Example:
        >>> import numpy as np
        >>> from portattn import masks
        >>> from portattn.distributed._agree import mask_fingerprint
        >>> a = mask_fingerprint(masks.key_lengths(np.array([3, 4])))
        >>> a == mask_fingerprint(masks.key_lengths(np.array([3, 4], dtype=np.int32)))
        True
        >>> a == mask_fingerprint(masks.key_lengths(np.array([3, 5])))
        False
    """
    digest = hashlib.blake2b(digest_size=8)
    if mask is None:
        digest.update(b"none")
        return digest.hexdigest()
    if not isinstance(mask, Mask):
        mask = dense(mask)
    digest.update(_plain(mask.structure()).encode())
    for a in mask.arrays:
        _add_values(digest, a)
    return digest.hexdigest()


def _plain(value: Any) -> str:
    """``value`` as text that does not depend on the process (no ids, no addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, numbers.Integral):  # a NumPy integer: its value, not its type
        return repr(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_plain(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_plain(v) for v in value)) + "}"
    if callable(value):  # a mask function: what it captures cannot be compared
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"callable {getattr(value, '__module__', '?')}.{name}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _add_values(digest: Any, a: Any) -> None:
    host = host_copy(a)
    if host is None:  # values that cannot be read here: their shape and dtype only
        digest.update(f"unread{tuple(a.shape)}{dtype_name(a.dtype)}".encode())
        return
    import numpy as np

    # one kind per family: ranks that built the same lengths as int32 and int64 agree
    if np.issubdtype(host.dtype, np.integer):
        host = host.astype(np.int64)
    host = np.ascontiguousarray(host)
    digest.update(f"{host.dtype.str}{host.shape}".encode())
    digest.update(host.tobytes())


def call_record(problem: Problem, query: Any, key: Any, value: Any,
                strategy: str) -> dict[str, str]:
    """What a rank's call must share with every other rank, as text per field."""
    fields = {}
    for name, x in (("query", query), ("key", key), ("value", value)):
        fields[f"{name}.shape"] = str(tuple(int(n) for n in x.shape))
        fields[f"{name}.dtype"] = dtype_name(x.dtype)
    mask = problem.given
    text = repr(mask)
    if len(text) > _MASK_TEXT:
        text = text[:_MASK_TEXT] + "..."
    fields.update({
        "query_length": str(problem.queries.length),
        "key_length": str(problem.keys.length),
        "layout": _layout_text(problem.queries),
        "strategy": strategy,
        "scale": repr(problem.scale),
        "softcap": repr(problem.softcap),
        "mask": f"{text} #{mask_fingerprint(mask)}",
    })
    return fields


def _layout_text(layout: Layout) -> str:
    if layout.assignment is None:
        return layout.kind
    chunks = hashlib.blake2b(repr(layout.assignment).encode(), digest_size=8).hexdigest()
    return f"balanced({layout.chunks_per_rank} chunks per rank) #{chunks}"


def encode(fields: dict[str, str] | None, error: str | None = None) -> bytes:
    """A record of :data:`RECORD_BYTES` bytes: the call's ``fields``, or the ``error``
    that stopped this rank (shortened to fit)."""
    record = {"fields": fields, "error": error}
    data = json.dumps(record).encode()
    while len(data) > RECORD_BYTES and error:
        error = error[:max(0, len(error) - (len(data) - RECORD_BYTES) - 16)] + "..."
        record["error"] = error
        data = json.dumps(record).encode()
    if len(data) > RECORD_BYTES:
        msg = f"a call's record takes {len(data)} bytes, more than {RECORD_BYTES}"
        raise ValueError(msg)
    return data.ljust(RECORD_BYTES, b"\0")  # JSON never holds a NUL byte: padding


def decode(payload: bytes) -> dict[str, Any]:
    """The record :func:`encode` made."""
    return json.loads(bytes(payload).rstrip(b"\0").decode())


def settle(payloads: list[bytes]) -> None:
    """Check every rank's record (in rank order) the same way on every rank: raise
    ``ValueError`` when a rank failed or the ranks disagree."""
    records = [decode(p) for p in payloads]
    size = len(records)
    failed = [(r, rec["error"]) for r, rec in enumerate(records) if rec["error"] is not None]
    if failed:
        who = _ranks_text([r for r, _ in failed])
        lines = [f"portattn.distributed.attention: {who} of {size} could not start the "
                 "call, so no rank runs it:"]
        lines += [f"    rank {r}: {error}" for r, error in failed]
        raise ValueError("\n".join(lines))
    differences = _differences([rec["fields"] for rec in records])
    if differences:
        lines = [f"portattn.distributed.attention: the {size} ranks of the call disagree, "
                 "so none of them runs it:"]
        lines += [f"    {line}" for line in differences]
        lines.append("every rank passes shards of the same shapes and dtypes, and the same "
                     "query_length, key_length, layout, strategy, scale, softcap and mask "
                     "(in global positions)")
        raise ValueError("\n".join(lines))


def _differences(every: list[dict[str, str]]) -> list[str]:
    """``name: value on ranks ...; other on rank ...`` for each field that differs."""
    lines = []
    for name in every[0]:
        holders: dict[str, list[int]] = {}
        for r, fields in enumerate(every):
            holders.setdefault(fields.get(name, "(missing)"), []).append(r)
        if len(holders) > 1:
            lines.append(f"{name}: " + "; ".join(f"{value} on {_ranks_text(ranks)}"
                                                 for value, ranks in holders.items()))
    return lines


def _ranks_text(ranks: list[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(str(r) for r in ranks))


def agree(problem: Problem, query: Any, key: Any, value: Any, strategy: str,
          exchange: Callable[[bytes], list[bytes]]) -> None:
    """The agreement step of one call, which engines run before their schedule, where
    host code runs: this rank's record (its shard shapes and dtypes, the whole
    sequence's lengths, the layout, ``strategy``, ``scale``, ``softcap`` and a digest
    of the mask) goes through ``exchange``, which returns every rank's record in rank
    order (one small collective), and every rank checks them all alike.

    Args:
        problem: the call's :class:`Problem`.
        query, key, value: this rank's shards.
        strategy: the strategy as chosen.
        exchange: ``exchange(payload) -> list[bytes]``.

    Raises:
        ValueError: a rank could not start the call, or the ranks disagree (the same
            error on every rank).
    """
    try:
        payload = encode(call_record(problem, query, key, value, strategy))
    except Exception as e:  # still join the exchange, or the others wait for this rank
        exchange(encode(None, failure_text(e)))
        raise
    settle(exchange(payload))
