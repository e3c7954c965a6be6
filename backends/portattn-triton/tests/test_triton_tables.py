"""The tables and bit tiles the kernels read, against the core's block form and
``mask.tile`` (host side only: no kernel runs here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from portattn_triton._plan import plan_for

from portattn import masks

sys.path.insert(0, str(Path(__file__).parent))
from maskcases import MASKS, WRITES

BATCH, HEADS, KV_HEADS, LQ, LK = (2,), 4, 2, 45, 70


def _plan(name, bias=None):
    q = torch.empty(*BATCH, HEADS, LQ, 16)
    k = torch.empty(*BATCH, KV_HEADS, LK, 16)
    return plan_for(q, k, mask=MASKS[name](BATCH, HEADS, LQ, LK), bias=bias)


def _states(plan, block_q, block_k):
    """The core's states, ``(Z, H, R, C)``."""
    states = masks.block_mask(plan.mask, LQ, LK, block_q, block_k).states
    lead = (*BATCH, HEADS)
    states = np.broadcast_to(states.reshape((1,) * (len(lead) + 2 - states.ndim)
                                            + states.shape), (*lead, *states.shape[-2:]))
    return states.reshape(-1, HEADS, *states.shape[-2:])


def _lists(table, z, h, r):
    zs = z if table.shape[0] > 1 else 0
    hs = h if table.shape[1] > 1 else 0
    row = table[zs, hs, r].tolist()
    count = (len(row) - 2) // 3
    partial = row[2:2 + row[0]]
    slots = row[2 + count:2 + count + row[0]]
    full = row[2 + 2 * count:2 + 2 * count + row[1]]
    return partial, slots, full


def _unpacked(bits, slot, block_q, block_k):
    weights = 1 << torch.arange(8, dtype=torch.int32)
    return ((bits[slot].to(torch.int32)[..., None] & weights) != 0).reshape(block_q, block_k)


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize(("block_q", "block_k"), [(16, 16), (32, 16)])
def test_rows_list_the_visited_tiles_and_bits_match_the_tiles(name, block_q, block_k):
    plan = _plan(name)
    grid = plan.grid(block_q, block_k)
    want = _states(plan, block_q, block_k)
    table = grid.rows[0].numpy()
    bits = grid.bits
    last_q, last_k = (LQ - 1) // block_q, (LK - 1) // block_k
    for z in range(want.shape[0]):
        for h in range(HEADS):
            for a in range(want.shape[2]):
                partial, slots, full = _lists(table, z, h, a)
                assert sorted(partial + full) == np.nonzero(want[z, h, a])[0].tolist()
                assert all(want[z, h, a, b] == masks.FULL for b in full)
                ragged_row = a == last_q and LQ % block_q != 0
                assert all(want[z, h, a, b] == masks.PARTIAL or ragged_row
                           or (b == last_k and LK % block_k != 0) for b in partial)
                q0, q1 = a * block_q, min(LQ, (a + 1) * block_q)
                for b, slot in zip(partial, slots, strict=True):
                    k0, k1 = b * block_k, min(LK, (b + 1) * block_k)
                    tile = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
                    if plan.rest is not None:
                        tile = plan.rest.tile(plan.xp, q0, q1, k0, k1, LQ, LK)
                        tile = tile.broadcast_to(*BATCH, HEADS, q1 - q0, k1 - k0)
                        tile = tile.reshape(-1, HEADS, q1 - q0, k1 - k0)[z, h]
                    if slot < 0:  # the formulas alone mask it: the other parts cover it
                        assert tile.all()
                    else:
                        got = _unpacked(bits, slot, block_q, block_k)[:q1 - q0, :k1 - k0]
                        assert torch.equal(got, tile)


@pytest.mark.parametrize("name", ["causal_documents", "block_layout_per_head"])
def test_columns_are_the_transpose(name):
    grid = _plan(name).grid(16, 32)
    rows, columns = grid.rows[0].numpy(), grid.columns[0].numpy()
    for z in range(rows.shape[0]):
        for h in range(rows.shape[1]):
            pairs = {(a, b, "p", s) for a in range(rows.shape[2])
                     for b, s in zip(*_lists(rows, z, h, a)[:2], strict=True)}
            pairs |= {(a, b, "f", -1) for a in range(rows.shape[2])
                      for b in _lists(rows, z, h, a)[2]}
            transposed = {(a, b, "p", s) for b in range(columns.shape[2])
                          for a, s in zip(*_lists(columns, z, h, b)[:2], strict=True)}
            transposed |= {(a, b, "f", -1) for b in range(columns.shape[2])
                           for a in _lists(columns, z, h, b)[2]}
            assert pairs == transposed


@pytest.mark.parametrize(("name", "lead"), [
    ("chunks_causal", (1, 1)),          # one table row per block for every head
    ("documents", (2, 1)),              # per batch element
    ("block_layout_per_head", (1, 4)),  # per head
    ("function_per_batch_and_head", (2, 4)),
])
def test_tables_vary_only_where_the_mask_does(name, lead):
    table, z_stride, h_stride, row_stride, count = _plan(name).grid(16, 16).rows
    assert tuple(table.shape[:2]) == lead
    assert (z_stride == 0) == (lead[0] == 1)
    assert (h_stride == 0) == (lead[1] == 1)
    assert row_stride == table.shape[-1] == 2 + 3 * count


def test_a_bias_makes_every_tile_partial():
    grid = _plan("chunks_causal", bias=torch.zeros(LQ, LK)).grid(16, 16)
    table = grid.rows[0]
    assert table[..., 1].eq(0).all()
    assert table[..., 0].gt(0).any()


def test_ragged_last_blocks_are_partial():
    q = torch.empty(1, 1, 40, 16)
    grid = plan_for(q, q).grid(16, 16)  # no mask: every tile full but the ragged ones
    table = grid.rows[0][0, 0]
    assert table[:2, 0].tolist() == [1, 1]  # the ragged key block
    assert table[2, 0].item() == 3  # the ragged query block
    assert not grid.has_bits


def test_shared_tables_for_masks_without_arrays():
    q = torch.empty(1, 2, 50, 16)
    first = plan_for(q, q, causal="bottom_right").grid(16, 16)
    again = plan_for(q, q, mask=masks.causal()).grid(16, 16)
    assert first is again


def _bits_of(grid):
    """The grid's bit tiles, unpacked, by the tile they belong to."""
    bits = np.unpackbits(grid.bits.numpy(), axis=-1, bitorder="little")
    return {tuple(c): bits[i] for i, c in enumerate(grid.coords.tolist())}


def test_a_mask_of_unchanged_tensors_shares_its_tables_across_calls():
    # one batch's mask, called by every layer of a model: built once
    q = torch.empty(1, 2, 50, 16)
    memory = torch.arange(60) // 15
    ids = memory[:50]
    first = plan_for(q, q, mask=masks.causal() & masks.documents(ids)).grid(16, 16)
    again = plan_for(q, q, mask=masks.causal() & masks.documents(ids)).grid(16, 16)
    assert again is first
    assert plan_for(q, q, mask=masks.documents(ids)).grid(16, 16) is not first
    assert plan_for(q, q, mask=masks.causal() & masks.documents(memory[10:])).grid(
        16, 16) is not first  # another view of the same memory: its own tables


@pytest.mark.parametrize("route", sorted(WRITES))
def test_tensors_changed_in_place_by_any_route_give_their_new_tables(route):
    q = torch.empty(1, 1, 48, 16)
    ids = torch.arange(48) // 20

    def grid(of):
        g = plan_for(q, q, mask=masks.documents(of)).grid(16, 16)
        _ = (g.rows, g.bits)  # built now, from the values the tensor holds now
        return g

    first = grid(ids)
    WRITES[route](ids, np.arange(48) // 7)
    changed = grid(ids)
    assert changed is not first
    fresh = grid(torch.arange(48) // 7)
    assert fresh is changed  # equal values: the same tables
    for tile, bits in _bits_of(fresh).items():
        np.testing.assert_array_equal(_bits_of(changed)[tile], bits)


def test_masks_of_equal_values_share_their_tables_however_made():
    q = torch.empty(1, 1, 40, 16)
    with torch.inference_mode():  # no version counter: the values decide
        ids = torch.arange(40) // 9
    assert plan_for(q, q, mask=masks.documents(ids)).grid(16, 16) is \
        plan_for(q, q, mask=masks.documents(torch.arange(40) // 9)).grid(16, 16)
    small = masks.dense(torch.rand(1, 1, 40, 40) < 0.5)
    assert _plan_grid(q, small) is _plan_grid(q, small)
    # a view of much more memory: only the view's values count
    view = masks.dense((torch.rand(700, 40, 40) < 0.5)[:1, None])
    assert _plan_grid(q, view) is _plan_grid(q, view)


def test_masks_too_large_to_compare_build_their_own_tables():
    n = 1100  # a dense mask over CONTENT_BYTES: cheaper built again than compared
    q = torch.empty(1, 1, n, 16)
    big = masks.dense(torch.rand(1, 1, n, n) < 0.5)
    assert _plan_grid(q, big) is not _plan_grid(q, big)


def _plan_grid(q, mask):
    return plan_for(q, q, mask=mask).grid(16, 16)
