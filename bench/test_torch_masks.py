"""Sparse masks on torch (CPU, float32, (1, 8, L, 64), one thread): portattn's
dispatch against compiled FlexAttention and SDPA, timed in turns in one run.

- Packed documents, ``causal() & documents(ids)`` with 8 documents of random lengths
  (about 10% of the pairs visible), at L = 4096 and 16384, dispatched to
  ``torch_sdpa_segments`` (torch's flash kernel once per document):

  - forward against ``torch.compile(flex_attention)`` with a ``create_block_mask`` of
    the same mask built beforehand. Target <= 1.0x. Also against the same with
    ``create_block_mask`` built in each call (what a training step with new
    documents pays), against portattn's ``torch_flex`` and against SDPA's causal
    forward;
  - forward + backward against SDPA's own causal forward + backward at the same
    shape. Target <= 0.35x.

- ``sliding_window(512) | global_tokens(16 positions)`` at L = 16384, forward,
  dispatched (``torch_sdpa_local``), against SDPA without a mask (target <= the share
  of visible pairs + 0.10; the share of pairs in the tiles the block form visits is
  reported too) and against portattn's ``torch_flex``.

Run: ``pytest -c pyproject.toml bench/test_torch_masks.py -s -p no:cacheprovider``
(``-k 4096`` for the short half). torch runs on one thread (the machine's other
users share the cores); ``PORTATTN_BENCH_ROUNDS`` sets the rounds (default 5).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
pytest.importorskip("portattn_torch")

import portattn  # noqa: E402
from portattn import masks  # noqa: E402

# torch.compile imports modules of torch's that use its own deprecated APIs
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FIGURES: dict[str, float] = {}
DOCS, WINDOW, GLOBALS = 8, 512, 16
SDPA = torch.nn.functional.scaled_dot_product_attention
ROUNDS = int(os.environ.get("PORTATTN_BENCH_ROUNDS", "5"))
SEGMENTS = "torch_sdpa_segments"


@pytest.fixture(scope="module", autouse=True)
def report():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print("\nsparse mask figures (ratios: portattn over the peer):")
    for name, value in FIGURES.items():
        print(f"    {name}: {value:.3g}")


def _qkv(length: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 8, length, 64, generator=g).requires_grad_(grad)
                 for _ in range(3))


def _document_ids(length: int) -> torch.Tensor:
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, length), DOCS - 1, replace=False))
    return torch.from_numpy(np.repeat(np.arange(DOCS), np.diff(np.concatenate(
        [[0], cuts, [length]]))))


def _visible(mask: masks.Mask, length: int) -> tuple[float, float]:
    """Share of the pairs allowed, and share in the tiles the block form visits."""
    from array_api_compat import array_namespace

    xp = array_namespace(torch.empty(0))
    bound = mask.bind(xp, (1,), 8, length, length)
    rows = 1024
    allowed = sum(int(bound.tile(xp, q0, min(q0 + rows, length), 0, length, length,
                                 length).sum()) for q0 in range(0, length, rows))
    form = masks.block_mask(bound, length, length, 128, 128)
    return allowed / length**2, form.visible


def _record(name: str, figures: tuple[float, float]) -> None:
    best, median = figures
    FIGURES[f"{name}, best"] = best
    FIGURES[f"{name}, median of rounds"] = median


PEERS = {
    "compiled flex (target <= 1.0)": "flex",
    "portattn torch_flex": "torch_flex",
    "SDPA causal forward": "causal",
}


@pytest.mark.benchmark(group="torch masks")
@pytest.mark.parametrize("peer", sorted(PEERS.values()))
@pytest.mark.parametrize("length", [4096, 16384])
def test_documents_forward(in_turns, length, peer):
    q, k, v = _qkv(length)
    ids = _document_ids(length)
    mask = masks.causal() & masks.documents(ids)
    assert portattn.explain(q, k, v, mask=mask).kernel.name == SEGMENTS

    def ours():
        return portattn.attention(q, k, v, mask=mask)

    if peer == "causal":
        def theirs():
            return SDPA(q, k, v, is_causal=True)
    elif peer == "torch_flex":
        def theirs():
            return portattn.attention(q, k, v, mask=mask, kernel="torch_flex")
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

        # a static compile per length: recompiling one for a new length (dynamic
        # shapes) fails in inductor's CPU flex template (torch 2.13)
        compiled = torch.compile(flex.flex_attention, dynamic=False)
        block_mask = flex.create_block_mask(mask_mod, 1, 1, length, length, device="cpu")

        def theirs():
            return compiled(q, k, v, block_mask=block_mask)

    with torch.no_grad():
        if peer != "causal":
            torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-5)
        figures = in_turns(ours, theirs, rounds=ROUNDS)
    pairs, tiles = _visible(mask, length)
    FIGURES[f"L={length} documents: visible pairs"] = pairs
    FIGURES[f"L={length} documents: visited tiles"] = tiles
    name = next(n for n, p in PEERS.items() if p == peer)
    _record(f"L={length} documents forward ({SEGMENTS}) / {name}", figures)


@pytest.mark.benchmark(group="torch masks")
@pytest.mark.parametrize("length", [4096])
def test_documents_forward_against_flex_building_its_mask(in_turns, length):
    q, k, v = _qkv(length)
    ids = _document_ids(length)
    mask = masks.causal() & masks.documents(ids)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

    # a static compile per length: recompiling one for a new length (dynamic shapes)
    # fails in inductor's CPU flex template (torch 2.13)
    compiled = torch.compile(flex.flex_attention, dynamic=False)

    def theirs():
        block_mask = flex.create_block_mask(mask_mod, 1, 1, length, length, device="cpu")
        return compiled(q, k, v, block_mask=block_mask)

    with torch.no_grad():
        figures = in_turns(lambda: portattn.attention(q, k, v, mask=mask), theirs,
                           rounds=ROUNDS)
    _record(f"L={length} documents forward / (create_block_mask + compiled flex)", figures)


@pytest.mark.benchmark(group="torch masks")
@pytest.mark.parametrize("length", [4096, 16384])
def test_documents_training_step_against_sdpa_causal(in_turns, length):
    q, k, v = _qkv(length, grad=True)
    mask = masks.causal() & masks.documents(_document_ids(length))
    assert portattn.explain(q, k, v, mask=mask).kernel.name == SEGMENTS

    def ours():
        portattn.attention(q, k, v, mask=mask).sum().backward()

    def theirs():
        SDPA(q, k, v, is_causal=True).sum().backward()

    _record(f"L={length} documents forward + backward ({SEGMENTS}) / SDPA causal "
            "(target <= 0.35)", in_turns(ours, theirs, rounds=ROUNDS))


@pytest.mark.benchmark(group="torch masks")
@pytest.mark.parametrize("peer", ["sdpa", "torch_flex"])
@pytest.mark.parametrize("length", [16384])
def test_window_and_global_tokens(in_turns, length, peer):
    q, k, v = _qkv(length)
    positions = torch.from_numpy(np.linspace(0, length - 1, GLOBALS).astype(np.int64))
    mask = masks.sliding_window(WINDOW) | masks.global_tokens(positions)
    kernel = portattn.explain(q, k, v, mask=mask).kernel.name
    assert kernel == "torch_sdpa_local"
    pairs, tiles = _visible(mask, length)

    def ours():
        return portattn.attention(q, k, v, mask=mask)

    def flexed():
        return portattn.attention(q, k, v, mask=mask, kernel="torch_flex")

    with torch.no_grad():
        if peer == "sdpa":
            figures = in_turns(ours, lambda: SDPA(q, k, v), rounds=ROUNDS)
        else:
            torch.testing.assert_close(ours(), flexed(), rtol=1e-4, atol=1e-5)
            figures = in_turns(ours, flexed, rounds=ROUNDS)
    FIGURES[f"L={length} window | globals: visible pairs"] = pairs
    FIGURES[f"L={length} window | globals: visited tiles"] = tiles
    if peer == "sdpa":
        _record(f"L={length} window | globals forward ({kernel}) / unmasked SDPA (target "
                f"<= {pairs + 0.1:.3f} by visible pairs, {tiles + 0.1:.3f} by visited "
                "tiles)", figures)
    else:
        _record(f"L={length} window | globals forward ({kernel}) / portattn torch_flex",
                figures)
