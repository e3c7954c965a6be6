"""Building a block form against FlexAttention's ``create_block_mask``, in turns.

The same masks at L = 16384 on the CPU, blocks of 128 x 128: packed documents (8 of
random lengths, ``causal() & documents(ids)``) and a window with global tokens. portattn
binds the mask to a call (reading the ids once) and classifies every tile from the
kinds' structure; ``create_block_mask`` evaluates the ``mask_mod`` at every pair.
Target: portattn <= 0.1x for documents.

Run: ``pytest -c pyproject.toml bench/test_block_form.py -s -p no:cacheprovider``.
"""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace

from portattn import masks

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

FIGURES: dict[str, float] = {}
L, DOCS, BLOCK = 16384, 8, 128


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nblock form figures:")
    for name, value in FIGURES.items():
        print(f"    {name}: {value:.3g}")


def _documents() -> tuple[np.ndarray, masks.Mask]:
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, L), DOCS - 1, replace=False))
    ids = np.repeat(np.arange(DOCS), np.diff(np.concatenate([[0], cuts, [L]])))
    return ids, masks.causal() & masks.documents(torch.from_numpy(ids))


def _window_and_globals() -> tuple[np.ndarray, masks.Mask]:
    positions = np.linspace(0, L - 1, 16).astype(np.int64)
    return positions, masks.sliding_window(512) | masks.global_tokens(
        torch.from_numpy(positions))


@pytest.mark.benchmark(group="block form")
@pytest.mark.parametrize("name", ["documents", "window_and_globals"])
def test_block_form_against_create_block_mask(in_turns, name):
    data, mask = {"documents": _documents, "window_and_globals": _window_and_globals}[name]()
    xp = array_namespace(mask.arrays[0])
    if name == "documents":
        ids = torch.from_numpy(data)

        def mask_mod(b, h, q, k):
            return (q >= k) & (ids[q] == ids[k])
    else:
        chosen = torch.zeros(L, dtype=torch.bool)
        chosen[torch.from_numpy(data)] = True

        def mask_mod(b, h, q, k):
            return ((q - k <= 512) & (q >= k)) | chosen[q] | chosen[k]

    def ours():
        # a new call's mask: bound (the ids read once) and classified tile by tile
        return masks.block_mask(mask.bind(xp, (1,), 1, L, L), L, L, BLOCK, BLOCK)

    def theirs():
        return flex.create_block_mask(mask_mod, 1, 1, L, L, device="cpu",
                                      BLOCK_SIZE=BLOCK)

    form, block = ours(), theirs()
    # the same tiles: FlexAttention counts partial and full ones separately
    tables = form.tables()
    assert int(tables.kv_num_blocks.sum() + tables.full_kv_num_blocks.sum()) == int(
        block.kv_num_blocks.sum() + block.full_kv_num_blocks.sum())
    best, median = in_turns(ours, theirs, rounds=5)
    target = " (target <= 0.1)" if name == "documents" else ""
    FIGURES[f"{name}: block_mask / create_block_mask{target}, best"] = best
    FIGURES[f"{name}: block_mask / create_block_mask, median of rounds"] = median
    FIGURES[f"{name}: visible share"] = form.visible
