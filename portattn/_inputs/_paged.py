"""A call of :func:`portattn.paged_attention` described: packed queries of many
sequences, the page pools, the block table and the lengths, read on the host where
the call is planned."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from .._lib import device_kind, dtype_name, namespace_name

if TYPE_CHECKING:
    from ..masks import Mask

__all__ = ["PagedInputs"]


class PagedInputs(NamedTuple):
    """A call of :func:`portattn.paged_attention`, checked: what a kernel that runs
    paged calls reads (:meth:`portattn.kernel.Kernel.run_paged`).

    ``query`` is ``(T, Hq, D)``; the pools ``(P, page, Hkv, D)``, or ``(P, Hkv, page,
    D)`` when ``head_major``; ``block_table`` ``(S, W)`` on the device and
    ``host_table`` its NumPy copy; ``query_starts`` (``S + 1`` ints) and
    ``key_lengths`` (``S`` ints) are host copies, ``key_counts`` the key lengths on the
    device. ``alibi_slopes`` and ``sinks`` are ``(S, Hq)``.
    """

    xp: Any
    device_obj: Any
    query: Any
    key_pages: Any
    value_pages: Any
    head_major: bool
    block_table: Any
    host_table: Any
    query_starts: list[int]
    key_lengths: list[int]
    key_counts: Any
    mask: Mask | None
    scale: float
    softcap: float | None
    alibi_slopes: Any
    sinks: Any

    @property
    def namespace(self) -> str:
        """The library's short name (``"numpy"``, ``"torch"``, ...)."""
        return namespace_name(self.xp)

    @property
    def device(self) -> str:
        """The device's kind (``"cpu"``, ``"cuda"``, ...)."""
        return "cpu" if self.device_obj is None else device_kind(self.device_obj)

    @property
    def dtype(self) -> str:
        """The queries' dtype name."""
        return dtype_name(self.query.dtype)

    @property
    def page_size(self) -> int:
        return self.key_pages.shape[2 if self.head_major else 1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_pages.shape[1 if self.head_major else 2]

    @property
    def compute_dtype(self) -> Any:
        xp, dtype = self.xp, self.query.dtype
        return dtype if dtype in (xp.float32, xp.float64) else xp.float32
