"""Settings: the configured() block, bad settings, the tile size read from the machine."""

from __future__ import annotations

import os

import numpy as np
import pytest
from portattn_numpy import Config, NumpyFastKernel, _config, configured

from portattn import attention, masks


def test_a_block_changes_settings_and_restores_them():
    before = _config.current()
    with configured(max_block_k=8) as inside:
        assert _config.current() is inside
        assert inside.max_block_k == 8
        with configured(try_fast=False):
            assert (_config.current().max_block_k, _config.current().try_fast) == (8, False)
    assert _config.current() is before


def test_an_unknown_setting_is_named():
    with pytest.raises(ValueError, match=r"takes the fields of Config .*got \['block_size'\]"), \
            configured(block_size=3):
        pass


def test_an_unknown_strategy_is_named():
    with pytest.raises(ValueError, match=r"strategies must be among .*got strategies=\['fancy'\]"):
        Config(strategies=("tiles", "fancy"))


def test_strategies_given_as_a_list_are_kept_as_a_tuple(check):
    with configured(strategies=["tiles"]) as settings:
        assert settings.strategies == ("tiles",)
        check((1, 2, 40, 16), (1, 2, 40, 16))  # planned: the settings hash


@pytest.mark.parametrize(("change", "message"), [
    ({"tile_bytes": 0}, r"tile_bytes must be a positive integer or None; got tile_bytes=0"),
    ({"tile_bytes": "big"}, r"tile_bytes must be .*got tile_bytes='big'"),
    ({"max_block_k": 0}, r"max_block_k must be a positive integer; got max_block_k=0"),
    ({"preferred_block_q": -5}, r"preferred_block_q must .*got preferred_block_q=-5"),
    ({"mask_step": 2.5}, r"mask_step must be a positive integer; got mask_step=2.5"),
    ({"min_squares": True}, r"min_squares must be a positive integer; got min_squares=True"),
    ({"compiled_blocks": "no"}, r"compiled_blocks must be True or False; got "
                                r"compiled_blocks='no'"),
    ({"on_tile": 3}, r"on_tile must be callable or None; got on_tile=3"),
])
def test_a_bad_setting_is_named_with_its_value(change, message):
    with pytest.raises(ValueError, match=message), configured(**change):
        pass


def test_one_strategy_name_alone_is_refused():
    with pytest.raises(ValueError, match=r"a sequence of names .*got strategies='tiles'"):
        Config(strategies="tiles")


@pytest.mark.parametrize("strategies", [("tiles",), ("diagonal", "tiles"), ("stacked",)])
def test_any_strategy_set_gives_the_same_answer(strategies, check):
    # stacked heads (small), then along the diagonal, then tiles: each left out in turn
    for lq in (20, 300):
        with configured(strategies=strategies):
            check((1, 4, lq, 16), (1, 2, lq, 16), mask=masks.causal())


def test_settings_are_read_when_the_call_is_planned(threads):
    # worker threads see the caller's settings: every tile is reported to its hook
    threads(2)
    seen = []
    q = np.ones((1, 4, 512, 8), np.float32)
    with configured(on_tile=lambda *tile: seen.append(tile)):
        attention(q, q, q, kernel="numpy_fast")
    assert sum((q1 - q0) * (k1 - k0) for *_, q0, q1, k0, k1 in seen) == 4 * 512 * 512


def test_l2_read_from_sysfs_when_sysconf_does_not_say(tmp_path, monkeypatch):
    for index, (level, size) in enumerate([("1", "48K"), ("2", "2048K"), ("3", "32M")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(level + "\n")
        (folder / "size").write_text(size + "\n")

    def no_answer(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_answer)
    assert _config._l2_bytes(tmp_path) == 2 << 20
    assert _config._l2_bytes(tmp_path / "missing") == 0


@pytest.mark.parametrize(("l2", "tile"), [
    (0, 2 << 20), (256 << 10, 2 << 20), (512 << 10, 2 << 20), (1 << 20, 2 << 20),
    (2 << 20, 4 << 20), (32 << 20, 8 << 20)])
def test_the_machines_tile_is_twice_its_l2_within_2_to_8_mib(l2, tile, monkeypatch):
    monkeypatch.setattr(_config, "_l2_bytes", lambda: l2)
    _config.machine_tile_bytes.cache_clear()
    try:
        assert _config.machine_tile_bytes() == tile
    finally:
        _config.machine_tile_bytes.cache_clear()


def test_queries_come_in_tall_tiles_and_fill_the_tile_behind_short_key_ranges():
    from portattn_numpy._plan import block_sizes

    config, elements = _config.Config(), (2 << 20) // 4  # a 2 MiB float32 tile
    tall = config.preferred_block_q
    assert block_sizes(4096, 4096, elements, config, heads=8) == (tall, elements // tall)
    assert block_sizes(4096, 256, elements, config, heads=8) == (2048, 256)
    assert block_sizes(700, 256, elements, config, heads=8) == (700, 256)  # all there is
    # few queries: the key block is as long as it may be
    assert block_sizes(64, 16384, elements, config, heads=8) == (64, config.max_block_k)
    # one head on two threads: tiles short enough to give each thread several units,
    # the keys filling the rest of the tile
    assert block_sizes(4096, 256, elements, config, threads=2) == (512, 256)
    assert block_sizes(4096, 4096, elements, config, threads=2) == (512, config.max_block_k)


@pytest.mark.parametrize(("chosen", "want"), [(256 << 10, 256 << 10), ("big", None),
                                              (None, None)])
def test_the_tile_size_tune_chose_is_used(chosen, want, monkeypatch, tiles, threads):
    # what ``python -m portattn tune`` chose, as every kernel reads it
    monkeypatch.setattr(NumpyFastKernel, "tuned", classmethod(
        lambda cls, setting: chosen if setting == "tile_bytes" else None))
    threads(1)
    q = np.zeros((1, 1, 4096, 64), np.float32)
    with configured(tile_bytes=None):  # the default: tune's choice, else the machine's
        attention(q, q, q, kernel="numpy_fast")
    expected = _config.machine_tile_bytes() if want is None else want  # a bad value: default
    # one head of 4096 queries and keys on one thread: query tiles of preferred_block_q
    # rows (at least min_units_per_thread of them), keys filling the rest of the tile
    config = _config.Config()
    rows = min(config.preferred_block_q, 4096 // config.min_units_per_thread)
    assert {q1 - q0 for _, _, q0, q1, _, _ in tiles} == {rows}
    assert max(k1 - k0 for *_, k0, k1 in tiles) == min(config.max_block_k, expected // 4 // rows)
