"""Block sizes per GPU generation, element size and head dimension.

Plain data and arithmetic (no Triton import), so the compile checks and the benchmark
script can list every configuration the launcher may pick. The table is chosen so that
each entry fits the shared memory of its generation and compiles without register
spills (checked by the plugin's compile tests for sm_80 and sm_90).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHS", "BACKWARD_MAX_DIM", "BLOCK_DIMS", "BackwardConfig", "Config", "block_dim",
           "delta_rows", "is_even", "pick_backward_config", "pick_config"]


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"


#: Generations with their own table: 80 (Ampere, Ada) and 90 (Hopper and newer).
ARCHS = (80, 90)
#: Padded head dimensions the kernel is compiled for (powers of two).
BLOCK_DIMS = (16, 32, 64, 128, 256)

# (arch, element bytes, padded head dim) -> config. float32 runs its matmuls as three
# TF32 products, which needs about three times the registers: smaller tiles.
_TABLE: dict[tuple[int, int, int], Config] = {
    (90, 2, 16): Config(128, 64, 4, 3),
    (90, 2, 32): Config(128, 64, 4, 3),
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


def block_dim(dim: int) -> int:
    """The padded (power of two, at least 16) size of a head dimension."""
    return max(16, 1 << (max(dim, 1) - 1).bit_length())


def pick_config(capability: tuple[int, int] | None, element_bytes: int, head_dim: int,
                value_head_dim: int) -> Config:
    """The block sizes for a device of compute ``capability`` (None: the interpreter)."""
    arch = 90 if capability is None or capability[0] >= 9 else 80
    size = 2 if element_bytes <= 2 else 4
    dim = max(block_dim(head_dim), block_dim(value_head_dim))
    key = (arch, size, dim)
    if not is_even(head_dim, value_head_dim):
        return _UNEVEN.get(key, _TABLE[key])
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


def delta_rows(value_head_dim: int) -> int:
    """Query rows per program of the backward's Delta pass (four warps)."""
    return 64 if block_dim(value_head_dim) <= 128 else 32


def pick_backward_config(capability: tuple[int, int] | None, element_bytes: int,
                         head_dim: int, value_head_dim: int) -> BackwardConfig:
    """The backward block sizes for a device of ``capability`` (None: the interpreter)."""
    arch = 90 if capability is None or capability[0] >= 9 else 80
    size = 2 if element_bytes <= 2 else 4
    dim = max(block_dim(head_dim), block_dim(value_head_dim))
    if dim > BACKWARD_MAX_DIM[size]:
        msg = (f"no backward for {element_bytes}-byte elements at head dims "
               f"{head_dim}, {value_head_dim} (at most {BACKWARD_MAX_DIM[size]})")
        raise ValueError(msg)
    return _BWD_TABLE[arch, size, dim]
