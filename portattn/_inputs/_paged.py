"""A call of :func:`portattn.paged_attention` described: packed queries of many
sequences, the page pools, the block table and the lengths, read on the host where
the call is planned, or kept on the device alone where they cannot be read (traced
by ``jax.jit``): a kernel then plans the call on the device, or refuses it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from .._lib import device_kind, dtype_name, namespace_name

if TYPE_CHECKING:
    from ..masks import Mask

__all__ = ["CHUNK_KEYS", "MAX_TILE_QUERIES", "PagedInputs", "QueryTiles"]

#: Keys a tile reads per step: the pages of one chunk, at least one page.
CHUNK_KEYS = 256
#: The longest query tile; a sequence with fewer queries takes the next power of two.
MAX_TILE_QUERIES = 64


class QueryTiles(NamedTuple):
    """Query tiles of one size: for each, its sequence, the position of its first
    query within the sequence, its queries in the packed batch, and the chunks of keys
    it reads (``first <= chunk < stop``, chunks of :attr:`PagedInputs.chunk_keys`)."""

    size: int
    sequence: list[int]
    position: list[int]
    rows: list[int]
    count: list[int]
    first: list[int]
    stop: list[int]


class PagedInputs(NamedTuple):
    """A call of :func:`portattn.paged_attention`, checked: what a kernel that runs
    paged calls reads (:meth:`portattn.kernel.Kernel.run_paged`).

    ``query`` is ``(T, Hq, D)``; the pools ``(P, page, Hkv, D)``, or ``(P, Hkv, page,
    D)`` when ``head_major``; ``block_table`` ``(S, W)`` on the device and
    ``host_table`` its NumPy copy; ``query_starts`` (``S + 1`` ints) and
    ``key_lengths`` (``S`` ints) are host copies, ``key_counts`` the key lengths and
    ``query_offsets`` the query starts on the device (int32). ``alibi_slopes`` and
    ``sinks`` are ``(S, Hq)``.

    Where the table, the lengths or the starts cannot be read now (:attr:`traced`:
    JAX tracers under ``jax.jit``), its host copy is None, the others' are kept as
    they are, and only their shapes were checked (without ``query_starts``,
    ``query_starts`` holds one query per sequence, known all the same): a kernel plans
    such a call on the device or refuses it in ``paged_reasons``
    (:meth:`host_plan_reason`).
    """

    xp: Any
    device_obj: Any
    query: Any
    key_pages: Any
    value_pages: Any
    head_major: bool
    block_table: Any
    host_table: Any
    query_starts: list[int] | None
    key_lengths: list[int] | None
    key_counts: Any
    query_offsets: Any
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
    def traced(self) -> bool:
        """Whether the table, the lengths or the starts cannot be read now, so the call
        cannot be planned on the host."""
        return any(host is None for host in (self.host_table, self.key_lengths,
                                             self.query_starts))

    @property
    def traced_arguments(self) -> list[str]:
        """The arguments whose values cannot be read now, for messages."""
        named = (("block_table", self.host_table), ("key_lengths", self.key_lengths),
                 ("query_starts", self.query_starts))
        return [name for name, host in named if host is None]

    def host_plan_reason(self) -> str | None:
        """Why a kernel that plans on the host cannot run this call (None: it can): a
        reason for ``paged_reasons``."""
        if not self.traced:
            return None
        return (f"{', '.join(self.traced_arguments)} traced (this kernel plans the call "
                f"on the host)")

    @property
    def page_size(self) -> int:
        return self.key_pages.shape[2 if self.head_major else 1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_pages.shape[1 if self.head_major else 2]

    @property
    def chunk_keys(self) -> int:
        """Keys a query tile reads per step: whole pages, ``CHUNK_KEYS`` (256) or one page
        when larger. Fixed by the page size alone, so never by the batch."""
        return max(1, CHUNK_KEYS // self.page_size) * self.page_size

    def query_tiles(self) -> list[QueryTiles]:
        """The call's query tiles, grouped by size (host work, one pass over the
        sequences). A sequence of ``n`` queries is cut into tiles of the next power of
        two above ``n`` (at most ``MAX_TILE_QUERIES``, 64): sizes fixed by the
        sequence alone, never by the batch."""
        if self.traced:
            msg = (f"a paged call's query tiles are planned on the host here, from "
                   f"{' and '.join(self.traced_arguments)}; got traced values (under "
                   f"jax.jit or torch.compile): pass concrete ones, or leave the call to "
                   f"a kernel that plans it on the device (jax_flash, for JAX)")
            raise ValueError(msg)
        groups: dict[int, QueryTiles] = {}
        chunk = self.chunk_keys
        for s, length in enumerate(self.key_lengths):
            start, stop = self.query_starts[s], self.query_starts[s + 1]
            n = stop - start
            if n == 0:
                continue
            size = min(MAX_TILE_QUERIES, 1 << (n - 1).bit_length())
            tiles = groups.setdefault(size, QueryTiles(size, [], [], [], [], [], []))
            for q0 in range(0, n, size):
                count = min(size, n - q0)
                first = length - n + q0  # the sequence's own position of query 0
                lo, hi = _key_range(self.mask, first, first + count, length)
                tiles.sequence.append(s)
                tiles.position.append(first)
                tiles.rows.append(start + q0)
                tiles.count.append(count)
                tiles.first.append(lo // chunk if hi > lo else 0)
                tiles.stop.append(-(-hi // chunk) if hi > lo else 0)
        return [groups[size] for size in sorted(groups)]

    @property
    def compute_dtype(self) -> Any:
        xp, dtype = self.xp, self.query.dtype
        return dtype if dtype in (xp.float32, xp.float64) else xp.float32


def _key_range(mask: Mask | None, p0: int, p1: int, length: int) -> tuple[int, int]:
    """The keys queries at positions ``[p0, p1)`` of a sequence of ``length`` keys may
    see, as ``[lo, hi)``."""
    if length == 0:
        return 0, 0
    if mask is None:
        return 0, length
    # With as many queries as keys, query i sits at position i (bottom-right aligned).
    lo, hi = mask.key_range(p0, p1, length, length)
    return max(0, lo), min(length, hi)
