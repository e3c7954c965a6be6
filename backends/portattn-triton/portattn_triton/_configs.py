"""Block sizes per GPU generation, element size and head dimension.

Plain data and arithmetic (no Triton import), so the compile checks and the benchmark
script can list every configuration the launcher may pick. The table is chosen so that
each entry fits the shared memory of its generation and compiles without register
spills (checked by the plugin's compile tests for sm_80 and sm_90).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHS", "BACKWARD_MAX_DIM", "BLOCK_DIMS", "DECODE_MAX_QUERIES", "DECODE_MAX_ROWS",
           "DISTANCE_BACKWARD_MAX_DIM_FLOAT32", "EXTRAS", "HEAVY_MAX_DIM_FLOAT32",
           "PAGED_STAGES", "BackwardConfig", "Config", "autotune_candidates",
           "backward_extra", "block_dim", "decode_config", "decode_max_rows",
           "decode_splits", "delta_rows", "is_even", "merge_warps", "paged_config",
           "paged_heights", "paged_max_rows", "pick_backward_config", "pick_config"]


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    """Split the mask-free key loop into producer and consumer warps (tensor-descriptor
    path; off in the table, see :func:`autotune_candidates`)."""

    def __str__(self) -> str:
        text = f"m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"
        return f"{text}-ws" if self.warp_specialize else text


#: Generations with their own table: 80 (Ampere, Ada) and 90 (Hopper and newer).
ARCHS = (80, 90)
#: Padded head dimensions the kernel is compiled for (powers of two).
BLOCK_DIMS = (16, 32, 64, 128, 256)

# (arch, element bytes, padded head dim) -> config. float32 runs its matmuls as three
# TF32 products, which needs about three times the registers: smaller tiles.
_TABLE: dict[tuple[int, int, int], Config] = {
    (90, 2, 16): Config(128, 64, 4, 3),
    (90, 2, 32): Config(128, 64, 8, 3),  # four warps spill with the in-kernel masks
    (90, 2, 64): Config(128, 64, 8, 3),
    (90, 2, 128): Config(128, 64, 8, 3),
    (90, 2, 256): Config(64, 32, 8, 2),
    (80, 2, 16): Config(128, 64, 4, 3),
    (80, 2, 32): Config(128, 64, 4, 3),
    (80, 2, 64): Config(128, 64, 4, 3),
    (80, 2, 128): Config(128, 64, 8, 2),
    (80, 2, 256): Config(64, 32, 8, 2),
    (90, 4, 16): Config(32, 32, 4, 2),
    (90, 4, 32): Config(32, 32, 4, 2),
    (90, 4, 64): Config(16, 32, 4, 2),
    (90, 4, 128): Config(16, 16, 4, 2),
    (90, 4, 256): Config(16, 16, 8, 1),
    (80, 4, 16): Config(32, 32, 4, 2),
    (80, 4, 32): Config(32, 32, 4, 2),
    (80, 4, 64): Config(16, 32, 4, 2),
    (80, 4, 128): Config(16, 16, 4, 2),
    (80, 4, 256): Config(16, 16, 8, 1),
}
# Head dims that are not powers of two load through masks along the head dim, which
# costs registers; where the table's entry would spill, a narrower one.
_UNEVEN: dict[tuple[int, int, int], Config] = {
    (90, 2, 256): Config(64, 16, 8, 2),
}
#: What a call's masked loop holds besides the band and length formulas: nothing
#: (None), bit tiles ("bits"), or a bias with or without them ("bias"); or, in every
#: loop, dropout or a score change by distance, with or without the others ("dropout",
#: "distance": the bias's entries where they have none of their own; the backward's
#: "distance_grad", whose dQ pass sums the score gradient along its diagonals too,
#: falls back to "distance"). Each is another tile in registers: where the table's
#: entry would spill then, another entry.
EXTRAS = (None, "bits", "bias", "dropout", "distance", "distance_grad")
# (extra, arch, element bytes, padded head dim) -> config, for even and uneven head dims.
# float32 at head dim 256 spills in every configuration: the kernel refuses those calls.
_EXTRA: dict[tuple[str | None, int, int, int], Config] = {
    ("bias", 80, 2, 32): Config(128, 64, 8, 3),
    ("bias", 80, 2, 64): Config(128, 64, 8, 3),
    ("bias", 80, 2, 256): Config(64, 32, 8, 1),
    ("bias", 90, 2, 16): Config(128, 64, 8, 3),
    ("bias", 90, 2, 32): Config(128, 64, 8, 3),
    ("bias", 90, 2, 128): Config(128, 32, 8, 3),
    ("bias", 90, 4, 32): Config(32, 32, 4, 1),
    ("bits", 80, 2, 16): Config(128, 64, 4, 2),
    ("bits", 80, 2, 32): Config(128, 64, 8, 3),
    ("bits", 80, 2, 256): Config(64, 32, 8, 1),
    ("distance", 80, 2, 16): Config(128, 64, 8, 3),
    ("distance", 80, 2, 32): Config(128, 64, 8, 2),
    ("distance", 80, 2, 64): Config(128, 32, 8, 2),
    ("distance", 90, 2, 64): Config(128, 32, 8, 3),
    ("distance", 90, 4, 16): Config(32, 32, 8, 2),
    ("dropout", 80, 2, 16): Config(128, 64, 8, 3),
    ("dropout", 80, 2, 128): Config(128, 32, 8, 2),
}
#: The largest padded head dim of a float32 call with a bias or bit tiles.
HEAVY_MAX_DIM_FLOAT32 = 128
#: The largest padded head dim of a float32 call with a score change and gradients (the
#: dQ pass sums the score gradient along its diagonals too).
DISTANCE_BACKWARD_MAX_DIM_FLOAT32 = 64


def block_dim(dim: int) -> int:
    """The padded (power of two, at least 16) size of a head dimension."""
    return max(16, 1 << (max(dim, 1) - 1).bit_length())


def pick_config(capability: tuple[int, int] | None, element_bytes: int, head_dim: int,
                value_head_dim: int, extra: str | None = None) -> Config:
    """The block sizes for a device of compute ``capability`` (None: the interpreter),
    for a call whose masked loop holds ``extra`` (one of :data:`EXTRAS`)."""
    arch = 90 if capability is None or capability[0] >= 9 else 80
    size = 2 if element_bytes <= 2 else 4
    dim = max(block_dim(head_dim), block_dim(value_head_dim))
    key = (arch, size, dim)
    for name in _falling_back(extra):
        if (name, *key) in _EXTRA:
            return _EXTRA[(name, *key)]
    if not is_even(head_dim, value_head_dim) and key in _UNEVEN:
        return _UNEVEN[key]
    return _TABLE[key]


def is_even(head_dim: int, value_head_dim: int) -> bool:
    """Both head dims are their padded size: no masks along the head dim."""
    return block_dim(head_dim) == head_dim and block_dim(value_head_dim) == value_head_dim


@dataclass(frozen=True)
class BackwardConfig:
    """Block sizes of the two backward passes: ``dkdv`` (one program per key block,
    ``block_n`` keys against ``block_m`` queries at a time) and ``dq`` (one program per
    query block)."""

    dkdv: Config
    dq: Config

    def __str__(self) -> str:
        return f"dkdv-{self.dkdv}_dq-{self.dq}"


_C = Config
# (arch, element bytes, padded head dim) -> backward config. The dK/dV pass keeps two
# float32 accumulators of block_n rows (and K, V) in registers, the dQ pass one of
# block_m rows (and Q, dO): each entry is the largest tile found to compile without
# spills, for even and uneven head dims alike (head dim 128 also with triton 3.6).
# float32 (three TF32 products) spills at head dim 256 in every configuration tried:
# no entry, gradients refused there.
_BWD_TABLE: dict[tuple[int, int, int], BackwardConfig] = {
    (90, 2, 16): BackwardConfig(_C(32, 128, 8, 3), _C(128, 64, 8, 3)),
    (90, 2, 32): BackwardConfig(_C(32, 128, 8, 3), _C(128, 64, 8, 3)),
    (90, 2, 64): BackwardConfig(_C(32, 128, 8, 3), _C(128, 64, 8, 3)),
    (90, 2, 128): BackwardConfig(_C(16, 64, 8, 2), _C(128, 64, 8, 2)),
    (90, 2, 256): BackwardConfig(_C(32, 32, 8, 1), _C(32, 32, 8, 1)),
    (80, 2, 16): BackwardConfig(_C(32, 32, 4, 2), _C(128, 32, 8, 3)),
    (80, 2, 32): BackwardConfig(_C(32, 64, 8, 2), _C(128, 32, 8, 3)),
    (80, 2, 64): BackwardConfig(_C(32, 32, 4, 2), _C(128, 32, 8, 3)),
    (80, 2, 128): BackwardConfig(_C(16, 64, 8, 2), _C(64, 32, 8, 2)),
    (80, 2, 256): BackwardConfig(_C(32, 32, 8, 1), _C(32, 32, 8, 1)),
    # float32: the same on both generations (small tiles; ptxas spills some mid sizes)
    **{(arch, 4, dim): BackwardConfig(dkdv, dq) for arch in ARCHS for dim, dkdv, dq in (
        (16, _C(32, 32, 4, 1), _C(16, 16, 4, 2)),
        (32, _C(16, 32, 2, 1), _C(16, 16, 4, 2)),
        (64, _C(16, 32, 4, 1), _C(32, 16, 4, 2)),
        (128, _C(16, 16, 8, 1), _C(16, 16, 8, 1)))},
}
#: The largest padded head dim with a backward, per element size.
BACKWARD_MAX_DIM = {2: 256, 4: 128}
# (extra, arch, element bytes, padded head dim) -> the pass's config where the table's
# would spill with bit tiles or a bias (and its gradient); see EXTRAS.
_BWD_EXTRA: dict[tuple[str | None, str, int, int, int], Config] = {
    ("bias", "dkdv", 80, 2, 256): Config(32, 16, 8, 1),
    ("bias", "dkdv", 80, 4, 16): Config(32, 16, 4, 1),
    ("bias", "dkdv", 80, 4, 32): Config(16, 16, 2, 1),
    ("bias", "dkdv", 80, 4, 64): Config(16, 32, 8, 1),
    ("bias", "dkdv", 90, 2, 128): Config(16, 32, 8, 2),
    ("bias", "dkdv", 90, 4, 32): Config(16, 32, 4, 1),
    ("bias", "dkdv", 90, 4, 64): Config(16, 32, 8, 1),
    ("bias", "dq", 80, 4, 64): Config(32, 16, 4, 1),
    ("bias", "dq", 90, 2, 32): Config(128, 64, 8, 2),
    ("bias", "dq", 90, 2, 64): Config(128, 32, 8, 3),
    ("bias", "dq", 90, 2, 128): Config(128, 32, 8, 2),
    ("bias", "dq", 90, 4, 32): Config(16, 16, 8, 2),
    ("bias", "dq", 90, 4, 128): Config(16, 16, 4, 1),
    ("bits", "dkdv", 80, 2, 32): Config(32, 64, 8, 1),
    ("bits", "dkdv", 80, 2, 64): Config(32, 32, 4, 1),
    ("bits", "dkdv", 90, 2, 128): Config(16, 32, 8, 2),
    ("bits", "dq", 80, 4, 32): Config(16, 16, 4, 1),
    ("bits", "dq", 80, 4, 64): Config(32, 16, 8, 2),
    ("bits", "dq", 90, 4, 64): Config(32, 16, 8, 2),
    ("bits", "dq", 90, 4, 128): Config(16, 32, 4, 1),
    ("distance", "dkdv", 80, 2, 32): Config(16, 64, 8, 2),
    ("distance", "dkdv", 80, 2, 128): Config(16, 32, 8, 2),
    ("distance", "dkdv", 80, 4, 16): Config(16, 16, 4, 1),
    ("distance", "dkdv", 90, 2, 64): Config(16, 128, 8, 3),
    ("distance", "dkdv", 90, 2, 256): Config(32, 16, 8, 1),
    ("distance", "dkdv", 90, 4, 16): Config(16, 32, 4, 1),
    ("distance", "dkdv", 90, 4, 32): Config(16, 16, 8, 1),
    ("distance", "dkdv", 90, 4, 64): Config(16, 16, 8, 1),
    ("distance_grad", "dq", 80, 2, 32): Config(128, 32, 8, 2),
    ("distance_grad", "dq", 80, 2, 64): Config(128, 16, 8, 3),
    ("distance_grad", "dq", 80, 4, 64): Config(32, 16, 8, 1),
    ("distance_grad", "dq", 90, 2, 16): Config(128, 32, 8, 3),
    ("distance_grad", "dq", 90, 2, 32): Config(128, 32, 8, 2),
    ("distance_grad", "dq", 90, 2, 64): Config(128, 16, 8, 3),
    ("distance_grad", "dq", 90, 2, 128): Config(128, 16, 8, 2),
    ("distance_grad", "dq", 90, 4, 32): Config(16, 16, 8, 1),
    ("distance_grad", "dq", 90, 4, 64): Config(16, 16, 8, 2),
    ("dropout", "dkdv", 80, 2, 16): Config(32, 32, 8, 2),
    ("dropout", "dq", 90, 2, 16): Config(128, 32, 8, 3),
    ("dropout", "dq", 90, 2, 32): Config(128, 32, 8, 2),
}


def delta_rows(value_head_dim: int) -> int:
    """Query rows per program of the backward's Delta pass (four warps)."""
    return 64 if block_dim(value_head_dim) <= 128 else 32


def pick_backward_config(capability: tuple[int, int] | None, element_bytes: int,
                         head_dim: int, value_head_dim: int,
                         extra: str | None = None) -> BackwardConfig:
    """The backward block sizes for a device of ``capability`` (None: the interpreter),
    for a call whose masked loops hold ``extra`` (one of :data:`EXTRAS`)."""
    arch = 90 if capability is None or capability[0] >= 9 else 80
    size = 2 if element_bytes <= 2 else 4
    dim = max(block_dim(head_dim), block_dim(value_head_dim))
    if dim > BACKWARD_MAX_DIM[size]:
        msg = (f"no backward for {element_bytes}-byte elements at head dims "
               f"{head_dim}, {value_head_dim} (at most {BACKWARD_MAX_DIM[size]})")
        raise ValueError(msg)
    base = _BWD_TABLE[arch, size, dim]

    def entry(kernel: str, default: Config) -> Config:
        for name in _falling_back(extra):
            if (name, kernel, arch, size, dim) in _BWD_EXTRA:
                return _BWD_EXTRA[(name, kernel, arch, size, dim)]
        return default

    return BackwardConfig(entry("dkdv", base.dkdv), entry("dq", base.dq))


def _falling_back(extra: str | None) -> tuple[str | None, ...]:
    """The extras whose entries serve ``extra``, first found first."""
    if extra == "distance_grad":
        return (extra, "distance", "bias")
    return (extra, "bias") if extra in ("dropout", "distance") else (extra,)


def backward_extra(extra: str | None) -> str | None:
    """The extra of the backward passes of a call whose forward holds ``extra``."""
    return "distance_grad" if extra == "distance" else extra


def autotune_candidates(capability: tuple[int, int] | None, element_bytes: int,
                        head_dim: int, value_head_dim: int) -> list[Config]:
    """The forward configurations ``flash_forward(..., autotune=True)`` times: the
    table's entry first, then its neighbours in block sizes, warps and stages. Those
    that do not fit a device fail to compile there and are dropped by the autotuner.
    Warp specialization is left out: Triton's Hopper pass fails outright (an
    exception, not a dropped candidate) on this kernel at four warps."""
    base = pick_config(capability, element_bytes, head_dim, value_head_dim)
    m, n = base.block_m, base.block_n
    found = [base]
    for block_m, block_n in ((m, n), (m, 2 * n), (m, n // 2), (m // 2, n), (2 * m, n)):
        if not (16 <= block_m <= 256 and 16 <= block_n <= 256):
            continue
        for warps in sorted({base.num_warps, 4, 8}):
            for stages in sorted({base.num_stages, 2, 3, 4}):
                c = Config(block_m, block_n, warps, stages)
                if c not in found:
                    found.append(c)
    return found


#: Decode: at most this many queries per head, and query rows per K/V head (the
#: grouped-query group times the queries), so every row fits one tile.
DECODE_MAX_QUERIES = 16
DECODE_MAX_ROWS = 64


def decode_max_rows(element_bytes: int, padded_dim: int) -> int:
    """The most packed rows a decode tile holds without spills: float32 (three TF32
    products) keeps fewer rows at the wider head dims, and none at head dim 256 (it
    spills on sm_80 even at 16 rows: the forward kernel serves those calls)."""
    if element_bytes <= 2 or padded_dim <= 32:
        return DECODE_MAX_ROWS
    return {64: 32, 128: 16}.get(padded_dim, 0)


# (extra, element bytes, padded head dim) -> (block_n, warps, stages) of split-KV decode
# where the default would spill with bit tiles or a bias.
_DECODE_EXTRA: dict[tuple[str | None, int, int], tuple[int, int, int]] = {
    ("bias", 2, 32): (128, 8, 3),
    ("bias", 2, 64): (64, 8, 3),
    ("bias", 2, 128): (64, 8, 3),
    ("bias", 2, 256): (16, 8, 1),
    ("bias", 4, 128): (16, 4, 1),
    ("bits", 2, 128): (64, 8, 3),
    ("bits", 2, 256): (32, 8, 1),
    ("distance", 2, 16): (128, 8, 3),
    ("distance", 2, 32): (64, 8, 3),
    ("distance", 4, 128): (16, 8, 1),
    (None, 2, 256): (32, 8, 1),
}


def decode_config(capability: tuple[int, int] | None, element_bytes: int, head_dim: int,
                  value_head_dim: int, rows: int, extra: str | None = None) -> Config:
    """Block sizes of the split-KV decode kernel for ``rows`` packed query rows: the
    tile is as tall as the rows (at least 16, the tensor cores' minimum) and the key
    blocks as wide as the registers allow (compile tests: no spills) with ``extra``
    in the masked loop (one of :data:`EXTRAS`)."""
    del capability  # one table for sm_80 and sm_90: the kernel is bandwidth-bound
    block_m = max(16, 1 << (max(rows, 1) - 1).bit_length())
    dim = max(block_dim(head_dim), block_dim(value_head_dim))
    size = 2 if element_bytes <= 2 else 4
    for name in _falling_back(extra):
        found = _DECODE_EXTRA.get((name, size, dim))
        if found is not None:
            return Config(block_m, *found)
    if element_bytes > 2:  # three TF32 products per product: narrower tiles
        return Config(block_m, 32 if dim <= 64 else 16, 8 if dim > 128 else 4, 2)
    if dim <= 64:
        return Config(block_m, 128, 4, 3)
    if dim <= 128:
        return Config(block_m, 64, 4, 3)
    return Config(block_m, 32, 8, 2)


# (element bytes, padded head dim, tile rows) -> (block_n, warps) of paged attention: a
# decode step's tile is as tall as its rows, a prefill's the tallest listed. Each entry
# is the widest key block found to compile without spills on sm_80 and sm_90 at that
# height, with every feature on (bands, ALiBi, softcap, sinks) and with none but the
# causal band, from a sweep of 16-128 keys and 4 or 8 warps (ptxas spills a few
# narrower ones, so the widths do not fall monotonically). The pages are gathered row by
# row, which Triton does not pipeline: the stages change nothing. float32 at head dim
# 256 spills at 16 rows already; those calls go to another kernel.
_PAGED: dict[tuple[int, int, int], tuple[int, int]] = {
    (2, 16, 16): (128, 8), (2, 16, 32): (128, 8), (2, 16, 64): (128, 8),
    (2, 16, 128): (128, 8),
    (2, 32, 16): (128, 8), (2, 32, 32): (64, 8), (2, 32, 64): (64, 8), (2, 32, 128): (64, 8),
    (2, 64, 16): (128, 8), (2, 64, 32): (128, 8), (2, 64, 64): (64, 8), (2, 64, 128): (64, 8),
    (2, 128, 16): (128, 8), (2, 128, 32): (128, 8), (2, 128, 64): (64, 8),
    (2, 256, 16): (64, 8), (2, 256, 32): (64, 8), (2, 256, 64): (32, 8),
    (4, 16, 16): (64, 4), (4, 16, 32): (64, 4), (4, 16, 64): (64, 4),
    (4, 32, 16): (128, 8), (4, 32, 32): (32, 8), (4, 32, 64): (32, 8),
    (4, 64, 16): (64, 4), (4, 64, 32): (64, 8), (4, 64, 64): (16, 8),
    (4, 128, 16): (64, 8),
}
#: Software pipeline stages of paged attention (see ``_PAGED``).
PAGED_STAGES = 2


def paged_heights(element_bytes: int, padded_dim: int) -> tuple[int, ...]:
    """The tile heights (packed query rows) paged attention has at this element size
    and padded head dim, shortest first; none where every tile would spill."""
    size = 2 if element_bytes <= 2 else 4
    return tuple(sorted(m for s, d, m in _PAGED if (s, d) == (size, padded_dim)))


def paged_max_rows(element_bytes: int, padded_dim: int) -> int:
    """The tallest tile of paged attention at this element size and padded head dim;
    0 where there is none."""
    return max(paged_heights(element_bytes, padded_dim), default=0)


def paged_config(element_bytes: int, head_dim: int, value_head_dim: int, rows: int) -> Config:
    """Block sizes of paged attention for tiles of ``rows`` packed query rows: the next
    power of two (at least 16), at most :func:`paged_max_rows` (a sequence with more
    rows is cut into several tiles)."""
    dim = max(block_dim(head_dim), block_dim(value_head_dim))
    size = 2 if element_bytes <= 2 else 4
    tallest = paged_max_rows(size, dim)
    if not tallest:
        msg = (f"paged attention has no tile for {element_bytes}-byte elements at head "
               f"dims {head_dim}, {value_head_dim}")
        raise ValueError(msg)
    block_m = min(tallest, max(16, 1 << (max(rows, 1) - 1).bit_length()))
    return Config(block_m, *_PAGED[size, dim, block_m], PAGED_STAGES)


def merge_warps(block_m: int, padded_value_dim: int) -> int:
    """Warps of the kernels that merge split-KV partial results: eight where the
    float32 accumulator of ``block_m`` rows would spill from four warps' registers."""
    return 4 if block_m * padded_value_dim <= 64 * 128 else 8


def decode_splits(programs: int, kv_len: int, block_n: int, sm_count: int | None) -> int:
    """How many slices of the keys the decode spreads over: enough programs for about
    two per multiprocessor, each slice at least four key blocks long."""
    tiles = -(-kv_len // block_n)
    if sm_count is None:  # the interpreter: a few splits, so the merge is exercised
        sm_count = 2
    want = -(-2 * sm_count // max(programs, 1))
    return max(1, min(want, tiles // 4))
