"""Block sizes per GPU generation, element size and head dimension.

Plain data and arithmetic (no Triton import), so the compile checks and the benchmark
script can list every configuration the launcher may pick. The table is chosen so that
each entry fits the shared memory of its generation and compiles without register
spills (checked by the plugin's compile tests for sm_80 and sm_90).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHS", "BLOCK_DIMS", "BackwardConfig", "Config", "block_dim", "is_even",
           "pick_backward_config", "pick_config"]


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
# float32 accumulators of block_n rows (and K, V) in registers: tall key blocks, short
# query blocks; the dQ pass the other way round.
_BWD_TABLE: dict[tuple[int, int, int], BackwardConfig] = {
    (90, 2, 16): BackwardConfig(_C(32, 128, 4, 3), _C(128, 32, 4, 3)),
    (90, 2, 32): BackwardConfig(_C(32, 128, 4, 3), _C(128, 32, 4, 3)),
    (90, 2, 64): BackwardConfig(_C(32, 128, 4, 3), _C(128, 32, 4, 3)),
    (90, 2, 128): BackwardConfig(_C(32, 128, 8, 2), _C(128, 32, 8, 2)),
    (90, 2, 256): BackwardConfig(_C(32, 64, 8, 1), _C(64, 32, 8, 1)),
    (80, 2, 16): BackwardConfig(_C(32, 128, 4, 3), _C(128, 32, 4, 3)),
    (80, 2, 32): BackwardConfig(_C(32, 128, 4, 3), _C(128, 32, 4, 3)),
    (80, 2, 64): BackwardConfig(_C(32, 128, 4, 3), _C(128, 32, 4, 3)),
    (80, 2, 128): BackwardConfig(_C(32, 128, 8, 2), _C(128, 32, 8, 2)),
    (80, 2, 256): BackwardConfig(_C(32, 64, 8, 1), _C(64, 32, 8, 1)),
    (90, 4, 16): BackwardConfig(_C(16, 32, 4, 2), _C(32, 16, 4, 2)),
    (90, 4, 32): BackwardConfig(_C(16, 32, 4, 2), _C(32, 16, 4, 2)),
    (90, 4, 64): BackwardConfig(_C(16, 32, 4, 2), _C(32, 16, 4, 2)),
    (90, 4, 128): BackwardConfig(_C(16, 16, 4, 1), _C(16, 16, 4, 1)),
    (90, 4, 256): BackwardConfig(_C(16, 16, 8, 1), _C(16, 16, 8, 1)),
    (80, 4, 16): BackwardConfig(_C(16, 32, 4, 2), _C(32, 16, 4, 2)),
    (80, 4, 32): BackwardConfig(_C(16, 32, 4, 2), _C(32, 16, 4, 2)),
    (80, 4, 64): BackwardConfig(_C(16, 32, 4, 2), _C(32, 16, 4, 2)),
    (80, 4, 128): BackwardConfig(_C(16, 16, 4, 1), _C(16, 16, 4, 1)),
    (80, 4, 256): BackwardConfig(_C(16, 16, 8, 1), _C(16, 16, 8, 1)),
}
_BWD_UNEVEN: dict[tuple[int, int, int], BackwardConfig] = {}


def pick_backward_config(capability: tuple[int, int] | None, element_bytes: int,
                         head_dim: int, value_head_dim: int) -> BackwardConfig:
    """The backward block sizes for a device of ``capability`` (None: the interpreter)."""
    arch = 90 if capability is None or capability[0] >= 9 else 80
    size = 2 if element_bytes <= 2 else 4
    key = (arch, size, max(block_dim(head_dim), block_dim(value_head_dim)))
    if not is_even(head_dim, value_head_dim):
        return _BWD_UNEVEN.get(key, _BWD_TABLE[key])
    return _BWD_TABLE[key]
