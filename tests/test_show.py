"""Pictures of masks: ``masks.show`` draws exactly the pairs the mask allows and the
tiles its block form names; ``masks.text`` writes the same pairs as characters."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from portattn import masks
from portattn.testing.plugin import require_library

IDS = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2],
                [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, -1, -1]], dtype=np.int32)
LENGTHS = np.array([3, 7, 12], dtype=np.int32)


@pytest.fixture
def plt():
    """pyplot on the Agg backend. matplotlib comes with the bench (the numpy env), where
    its absence fails the run; elsewhere the drawing tests skip without it."""
    require_library("matplotlib", backend="numpy")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


def arange_pairs(lq, lk):
    return np.arange(lq)[:, None], np.arange(lk)[None, :]


def expected(kind, lq, lk):
    """The pairs of each case, written from the definitions (True = attend)."""
    i, j = arange_pairs(lq, lk)
    if kind == "causal":  # bottom-right: query i sits at i + Lk - Lq
        return j <= i + lk - lq
    if kind == "sliding_window":
        return (j >= i - 2) & (j <= i + 1)
    if kind == "documents":  # batch element 1
        ids = IDS[1]
        return (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    if kind == "union":  # prefix-LM of batch element 1: causal, or both below 7
        return (j <= i) | ((i < LENGTHS[1]) & (j < LENGTHS[1]))
    if kind == "key_lengths":  # batch element 2
        return np.broadcast_to(j < LENGTHS[2], (lq, lk))
    raise AssertionError(kind)


def build(kind, backend):
    """``(mask, q_len, kv_len, batch)`` of each case, its arrays in ``backend``."""
    if kind == "causal":
        return masks.causal(), 6, 9, 0
    if kind == "sliding_window":
        return masks.sliding_window(2, 1), 8, 8, 0
    if kind == "documents":
        return masks.documents(backend.asarray(IDS)), 12, 12, 1
    if kind == "union":
        return masks.causal() | masks.prefix(backend.asarray(LENGTHS)), 12, 12, 1
    if kind == "key_lengths":
        return masks.key_lengths(backend.asarray(LENGTHS)), 5, 12, 2
    raise AssertionError(kind)


KINDS = ["causal", "sliding_window", "documents", "union", "key_lengths"]


def as_text(allowed):
    return "\n".join("".join("#" if a else "." for a in row) for row in allowed)


# --- text ------------------------------------------------------------------------------


def test_text_of_a_window_is_the_documented_picture():
    assert masks.text(masks.causal() & masks.sliding_window(2), 5, 5) == (
        "#....\n##...\n###..\n.###.\n..###")


def test_text_aligns_causal_masks_as_documented():
    assert masks.text(masks.causal(), 3, 5) == "###..\n####.\n#####"
    assert masks.text(masks.causal("top_left"), 3, 5) == "#....\n##...\n###.."
    assert masks.text(None, 2, 3) == "###\n###"


@pytest.mark.parametrize("kind", KINDS)
def test_text_writes_the_dense_mask(kind, backend):
    mask, lq, lk, batch = build(kind, backend)
    assert masks.text(mask, lq, lk, batch=batch) == as_text(expected(kind, lq, lk))


def test_text_picks_the_batch_element_and_head():
    lengths = np.array([1, 3], dtype=np.int32)
    assert masks.text(masks.key_lengths(lengths), 2, 4, batch=1) == "###.\n###."
    assert masks.text(masks.documents(IDS), 12, 12, batch=0).splitlines()[3] == (
        "...####.....")
    per_head = np.zeros((2, 3, 2, 2), dtype=bool)
    per_head[1, 2, 0, 1] = True  # one pair, in batch element 1, head 2
    assert masks.text(masks.dense(per_head), 2, 2, batch=1, head=2) == ".#\n.."
    assert masks.text(per_head, 2, 2, batch=1, head=1) == "..\n.."  # a bare array: dense


def test_text_gives_a_mask_function_the_batch_and_head_asked_for():
    fn = masks.function(lambda b, h, q, k: (q + k + b + 2 * h) % 3 == 0)
    i, j = arange_pairs(3, 4)
    assert masks.text(fn, 3, 4, batch=2, head=1) == as_text((i + j + 2 + 2) % 3 == 0)


# --- show ------------------------------------------------------------------------------


def pairs_layer(ax):
    (image,) = [im for im in ax.images if im.get_gid() == "pairs"]
    return np.asarray(image.get_array()).astype(bool)


def tiles_drawn(ax, block_q, block_k, shape):
    """The state drawn for each tile, from the rectangles' centres."""
    drawn = np.full(shape, -1)
    for state, name in ((masks.FULL, "full"), (masks.PARTIAL, "partial"),
                        (masks.HIDDEN, "skipped")):
        (collection,) = [c for c in ax.collections if c.get_gid() == f"tiles:{name}"]
        for path in collection.get_paths():
            x, y = path.vertices[:4].mean(axis=0)
            a, b = int((y + 0.5) // block_q), int((x + 0.5) // block_k)
            assert drawn[a, b] == -1, f"tile {(a, b)} drawn twice"
            drawn[a, b] = state
    return drawn


@pytest.mark.parametrize("kind", KINDS)
def test_show_draws_the_dense_mask(kind, backend, plt):
    mask, lq, lk, batch = build(kind, backend)
    ax = masks.show(mask, lq, lk, batch=batch)
    want = expected(kind, lq, lk)
    np.testing.assert_array_equal(pairs_layer(ax), want)
    assert repr(mask) in ax.get_title().replace("\n", " ")
    assert f"{want.mean():.1%} of {lq}x{lk} pairs allowed" in ax.get_title()
    assert not [c for c in ax.collections if (c.get_gid() or "").startswith("tiles:")]


@pytest.mark.parametrize(("kind", "block"), [("causal", (2, 4)), ("sliding_window", (3, 3)),
                                             ("documents", (4, 4)), ("union", (5, 3)),
                                             ("key_lengths", (2, 5))])
def test_show_marks_each_tile_as_the_block_form_does(kind, block, backend, plt):
    mask, lq, lk, batch = build(kind, backend)
    ax = masks.show(mask, lq, lk, block=block, batch=batch)
    np.testing.assert_array_equal(pairs_layer(ax), expected(kind, lq, lk))
    # the block form of the mask bound to a call of this batch shape
    batch_shape = () if kind in ("causal", "sliding_window") else (
        IDS.shape[0] if kind == "documents" else LENGTHS.shape[0],)
    bound = mask.bind(backend.xp, batch_shape, 1, lq, lk, backend.device)
    states = masks.block_mask(bound, lq, lk, *block).states
    states = np.broadcast_to(states, (*batch_shape, 1, *states.shape[-2:]))
    states = states.reshape(-1, *states.shape[-2:])[batch]
    drawn = tiles_drawn(ax, *block, states.shape)
    np.testing.assert_array_equal(drawn, states)
    counts = {name: int((states == s).sum()) for s, name in (
        (masks.FULL, "full"), (masks.PARTIAL, "partial"), (masks.HIDDEN, "skipped"))}
    assert (f"{block[0]}x{block[1]} tiles: {counts['full']} full, {counts['partial']} "
            f"partial, {counts['skipped']} skipped") in ax.get_title()


def test_show_tiles_of_a_window_skip_far_tiles(plt):
    # Hand-checked: a 16x16 window of 4 keys back, in 4x4 tiles, is partial on the
    # diagonal and just below it, skipped elsewhere; causal alone is full below.
    ax = masks.show(masks.causal() & masks.sliding_window(4), 16, 16, block=4)
    drawn = tiles_drawn(ax, 4, 4, (4, 4))
    diag = np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool)
    np.testing.assert_array_equal(drawn, np.where(diag, masks.PARTIAL, masks.HIDDEN))
    ax = masks.show(masks.causal(), 16, 16, block=(4, 4))
    want = np.where(np.tri(4, k=-1, dtype=bool), masks.FULL,
                    np.where(np.eye(4, dtype=bool), masks.PARTIAL, masks.HIDDEN))
    np.testing.assert_array_equal(tiles_drawn(ax, 4, 4, (4, 4)), want)
    assert "4x4 tiles: 6 full, 4 partial, 6 skipped" in ax.get_title()


def test_show_draws_on_the_axes_given_with_a_legend(plt):
    fig, ax = plt.subplots()
    assert masks.show(masks.causal(), 4, 4, block=2, ax=ax) is ax
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["allowed pair", "hidden pair", "full tile (no elementwise mask)",
                      "partial tile (elementwise mask)", "skipped tile"]
    assert len(fig.axes) == 1


def test_show_names_the_batch_element_drawn(plt):
    ax = masks.show(masks.documents(IDS), 12, 12, batch=1)
    assert "(batch 1)" in ax.get_title()
    ax = masks.show(masks.causal(), 4, 4, batch=3)  # the same for every element
    assert "batch" not in ax.get_title()


@pytest.mark.parametrize(("lq", "lk", "block"), [(10, 10, (4, 4)), (6, 9, (4, 2)), (3, 8, (5, 3))])
def test_tile_boxes_lie_on_the_edges_of_their_cells(lq, lk, block, plt):
    # A tile of rows [q0, q1) and keys [k0, k1) covers pixels from q0 - 0.5 to q1 - 0.5
    # (and k0 - 0.5 to k1 - 0.5): its box must lie exactly there, nothing inside it
    # and no cell of the tile outside it. Tiles cut by the call's end stop there.
    ax = masks.show(masks.causal() & masks.sliding_window(3), lq, lk, block=block)
    block_q, block_k = block
    boxes = [path.vertices[:4] for c in ax.collections if c.get_gid().startswith("tiles:")
             for path in c.get_paths()]
    assert len(boxes) == -(-lq // block_q) * -(-lk // block_k)
    for corners in boxes:
        (x0, y0), (x1, y1) = corners.min(axis=0), corners.max(axis=0)
        a, b = int(y0 + 0.5) // block_q, int(x0 + 0.5) // block_k
        assert (x0, x1) == (b * block_k - 0.5, min((b + 1) * block_k, lk) - 0.5)
        assert (y0, y1) == (a * block_q - 0.5, min((a + 1) * block_q, lq) - 0.5)


def test_global_tokens_are_named_by_their_positions(backend, plt):
    positions = backend.asarray(np.array([0, 5], dtype=np.int32))
    ax = masks.show(masks.sliding_window(1) | masks.global_tokens(positions), 8, 8)
    assert ax.get_title().splitlines()[0] == (
        "(sliding_window(left=1, right=0) | global_tokens([0, 5]))")


def test_global_tokens_of_the_batch_element_drawn_and_many_are_counted(plt):
    per_batch = np.array([[0, 5], [3, -1]], dtype=np.int32)  # -1: unused
    ax = masks.show(masks.causal() & masks.global_tokens(per_batch), 8, 8, batch=1)
    assert ax.get_title().splitlines()[0] == "causal(bottom_right) & global_tokens([3])"
    assert "(batch 1)" in ax.get_title()
    many = masks.global_tokens(np.arange(0, 60, 3, dtype=np.int32))
    title = masks.show(many, 64, 64).get_title().replace("\n", " ")
    assert "global_tokens([0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, ... (20 positions)])" \
        in title


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("function", [masks.show, masks.text])
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"q_len": -1}, ValueError, r"q_len must be at least 1; got q_len=-1"),
    ({"kv_len": 0}, ValueError, r"kv_len must be at least 1; got kv_len=0"),
    ({"q_len": 2.5}, TypeError, r"q_len must be an int; got q_len=2.5"),
    ({"kv_len": True}, TypeError, r"kv_len must be an int; got kv_len=True"),
    ({"batch": 2}, ValueError, r"batch=2 is out of range: the mask holds 2 batch elements"),
    ({"batch": -1}, ValueError, r"batch must be a non-negative index; got batch=-1"),
    ({"head": "0"}, TypeError, r"head must be an int; got head='0'"),
    ({"mask": "causal"}, TypeError, r"expects a portattn.masks mask.*got mask='causal'"),
])
def test_bad_arguments_are_named(function, kwargs, error, match):
    args = {"mask": masks.documents(IDS), "q_len": 12, "kv_len": 12, **kwargs}
    with pytest.raises(error, match=match):
        function(args.pop("mask"), args.pop("q_len"), args.pop("kv_len"), **args)


def test_a_head_out_of_range_is_named():
    per_head = masks.dense(np.ones((2, 4, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"head=2 is out of range: the mask holds 2 heads"):
        masks.text(per_head, 4, 4, head=2)


@pytest.mark.parametrize("block", [(0, 64), (8,), (8, 8, 8), -4, (8, True)])
def test_a_bad_block_is_named(block, plt):
    with pytest.raises(ValueError, match=r"block must be \(block_q, block_k\), two positive "
                                         r"ints; got block="):
        masks.show(masks.causal(), 8, 8, block=block)
    with pytest.raises(TypeError, match=r"got block=\('a', 'b'\)"):
        masks.show(masks.causal(), 8, 8, block=("a", "b"))


def test_bad_axes_and_oversized_calls_are_refused(plt):
    with pytest.raises(TypeError, match=r"ax must be a matplotlib Axes or None; got ax=3"):
        masks.show(masks.causal(), 4, 4, ax=3)
    with pytest.raises(ValueError, match=r"text is for small calls: q_len \* kv_len = "
                                         r"200 \* 200 = 40000 exceeds 16384; use show"):
        masks.text(masks.causal(), 200, 200)
    with pytest.raises(ValueError, match=r"show is for small calls"):
        masks.show(masks.causal(), 1 << 13, 1 << 13)


def test_a_mask_that_does_not_fit_the_call_says_so():
    with pytest.raises(ValueError, match=r"documents query_ids must have shape"):
        masks.text(masks.documents(IDS), 5, 12)


def test_without_matplotlib_show_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(ImportError, match=r'portattn.masks.show needs matplotlib; install '
                                          r'it with pip install "portattn\[plot\]"'):
        masks.show(masks.causal(), 4, 4)
    assert masks.text(masks.causal(), 2, 2) == "#.\n##"  # text needs no matplotlib


def test_importing_the_masks_imports_no_plotting_or_array_library():
    code = textwrap.dedent("""
        import sys, portattn, portattn.masks
        print(sorted(m for m in ("matplotlib", "numpy", "torch", "jax", "dask")
                     if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
