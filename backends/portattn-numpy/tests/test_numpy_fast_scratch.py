"""Scratch memory kept from call to call: per thread, per name, grown as needed, and
never shared with a call made inside a call."""

from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest
from portattn_numpy import _scratch, configured

from portattn import attention, masks
from portattn.testing import assert_close, oracle

F32 = np.dtype(np.float32)


def test_a_buffer_is_kept_and_grown():
    with _scratch.reusing():
        first = _scratch.take("test.a", (4, 8), F32)
        again = _scratch.take("test.a", (2, 16), F32)
        other = _scratch.take("test.b", (4, 8), F32)
        larger = _scratch.take("test.a", (64, 64), F32)
        assert again.shape == (2, 16)
        assert np.shares_memory(first, again)
        assert not np.shares_memory(first, other)
        assert not np.shares_memory(first, larger)  # grown: a new buffer
        assert np.shares_memory(larger, _scratch.take("test.a", (4, 8), F32))
        assert _scratch.take("test.a", (4, 8), np.dtype(np.float64)).dtype == np.float64


def _huge_page_mode():
    try:
        modes = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return modes.split("[")[1].split("]")[0]


def _mapping_flags(address):
    """``{field: value}`` of the ``/proc/self/smaps`` entry of the mapping holding
    ``address``."""
    found = None
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head, *rest = line.split()
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end ...
            if found is not None:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            found = {} if start <= address < end else None
        elif found is not None:
            found[head.rstrip(":")] = rest[0] if rest else ""
    return found


def test_a_large_buffer_starts_on_a_huge_page_and_asks_for_huge_pages():
    with _scratch.reusing():
        small = _scratch.take("test.small", (1000,), F32)
        tile = _scratch.take("test.tile", (512, 1040), F32)  # a 2 MiB float32 tile
        tile[...] = 1
        assert tile.ctypes.data % (2 << 20) == 0
        assert small.flags.writeable
        assert tile.flags.writeable
        mode = _huge_page_mode()
        if mode not in {"always", "madvise"}:
            pytest.skip(f"this system does not give huge pages (mode: {mode})")
        flags = _mapping_flags(tile.ctypes.data)
        if "THPeligible" not in flags:
            pytest.skip("this kernel's smaps does not say THPeligible")
        assert flags["THPeligible"] == "1"


def test_a_call_inside_a_call_and_other_threads_get_their_own():
    with _scratch.reusing():
        outer = _scratch.take("test.c", (16,), F32)
        with _scratch.reusing():
            assert not np.shares_memory(outer, _scratch.take("test.c", (16,), F32))
        assert np.shares_memory(outer, _scratch.take("test.c", (16,), F32))
        seen = []
        worker = threading.Thread(target=lambda: seen.append(_scratch.take("test.c", (16,),
                                                                           F32)))
        worker.start()
        worker.join()
        assert not np.shares_memory(outer, seen[0])


def _inputs(seed, shape_q, shape_k):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape_q).astype(np.float32),
            rng.standard_normal(shape_k).astype(np.float32),
            rng.standard_normal(shape_k).astype(np.float32))


def _oracle_out(q, k, v, **kwargs):
    return oracle(*(a.astype(np.float64) for a in (q, k, v)), **kwargs)[0]


@pytest.mark.parametrize(("strategy", "shape", "mask"), [
    ("tiles", (1, 2, 600, 16), None),
    ("diagonal", (1, 2, 300, 16), masks.causal()),
    ("stacked", (1, 4, 16, 8), masks.causal()),
], ids=["tiles", "diagonal", "stacked"])
def test_attention_inside_a_hook_leaves_the_outer_call_intact(strategy, shape, mask,
                                                               results_of):
    # the hook runs a call of the same kind while the outer one holds its buffers
    q, k, v = _inputs(0, shape, shape)
    inner_q, inner_k, inner_v = _inputs(1, shape, shape)
    inner = []

    def hook(*_):
        if not inner:  # the inner call sees this hook too: run it once
            inner.append(None)
            inner[0] = attention(inner_q, inner_k, inner_v, kernel="numpy_fast", mask=mask)

    with configured(on_tile=hook):
        out = attention(q, k, v, kernel="numpy_fast", mask=mask)
    assert_close(out, _oracle_out(q, k, v, mask=mask), "float32", "out")
    assert_close(inner[0], _oracle_out(inner_q, inner_k, inner_v, mask=mask), "float32",
                 "inner")
    assert results_of(strategy)


def test_later_calls_of_other_shapes_reuse_the_memory_correctly():
    for seed, (lq, lk) in enumerate([(600, 700), (37, 53), (600, 700), (1, 4096)]):
        q, k, v = _inputs(seed, (1, 8, lq, 32), (1, 8, lk, 32))
        out = attention(q, k, v, kernel="numpy_fast", mask=masks.causal())
        assert_close(out, _oracle_out(q, k, v, mask=masks.causal()), "float32", "out")
