"""Masks on NumPy through dispatch, against the same call without a mask, in turns.

(1, 8, L, 64) float32, ``portattn.attention`` with no kernel forced (numpy_fast reads
every mask kind through its block form):

- packed documents: 8 documents of random lengths in one row, ``causal() &
  documents(ids)``, lengths drawn until 10% of the pairs (+-0.5%) are allowed; L =
  4096 and 16384. Target: masked / unmasked <= 0.25.
- the same packed documents against torch's FlexAttention, compiled, on the same
  CPU and the same data (its ``create_block_mask`` built beforehand), when torch is
  installed. Target: <= 1.0.
- ``sliding_window(512) | global_tokens(16 positions)`` at L = 16384. Target: masked /
  unmasked <= the share of pairs the mask allows + 0.10 (the block form's share of
  visible tiles on the kernel's grid is printed beside it). numpy_fast computes it in
  three parts (the window, the global keys, the global rows); ``-k block_form`` times
  the same call through the union's block form (``split_global_tokens=False``) too.

Each line names the kernel that ran. Run::

    pytest -c pyproject.toml bench/test_numpy_masks.py -p no:cacheprovider -s
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import portattn
from portattn import masks

pytest.importorskip("portattn_numpy")

HEADS, HEAD_DIM, DOCS = 8, 64, 8
ROUNDS = {4096: 8, 16384: 3}
FIGURES: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print("\nmasks on NumPy, over the same call without a mask (or the peer named), "
          "in turns:")
    for name, line in FIGURES.items():
        print(f"    {name}: {line}")


def _inputs(n: int) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(n)
    return tuple(rng.standard_normal((1, HEADS, n, HEAD_DIM), dtype=np.float32)
                 for _ in range(3))


def packed_ids(n: int, share: float = 0.10, docs: int = DOCS) -> tuple[Any, float]:
    """Document ids of ``docs`` documents of random lengths packed into ``n`` tokens,
    the first draw (seeds 0, 1, ...) whose causal pairs are ``share`` +-0.005 of all;
    and that share."""
    for seed in range(10_000):
        rng = np.random.default_rng(seed)
        cuts = np.sort(rng.choice(np.arange(1, n), docs - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [n]]))
        allowed = float((lengths * (lengths + 1) // 2).sum()) / (n * n)
        if abs(allowed - share) <= 0.005:
            return np.repeat(np.arange(docs), lengths)[None], allowed
    msg = f"no draw of {docs} documents in {n} tokens allows {share:.0%} of the pairs"
    raise RuntimeError(msg)


def _window_and_globals(n: int) -> tuple[Any, float]:
    """``sliding_window(512) | global_tokens(16 positions)`` and the share of pairs it
    allows."""
    positions = np.sort(np.random.default_rng(1).choice(n, 16, replace=False))
    mask = masks.sliding_window(512) | masks.global_tokens(positions)
    bound = mask.bind(np, (1,), HEADS, n, n)
    allowed = sum(int(np.broadcast_to(bound.tile(np, a, min(n, a + 1024), 0, n, n, n),
                                      (min(n, a + 1024) - a, n)).sum())
                  for a in range(0, n, 1024))
    return mask, allowed / (n * n)


def _measure(in_turns: Any, benchmark: Any, name: str, n: int, mask: Any, allowed: float,
             target: float, **settings: Any) -> None:
    from portattn_numpy import configured

    q, k, v = _inputs(n)
    plan = portattn.explain(q, k, v, mask=mask)
    kernel = plan.kernel.name

    def masked() -> Any:
        with configured(**settings):
            return portattn.attention(q, k, v, mask=mask)

    best, median = in_turns(masked, lambda: portattn.attention(q, k, v), ROUNDS[n])
    config = _grid()
    visible = plan.inputs.blocks(*config).visible
    benchmark.extra_info.update(n=n, kernel=kernel, allowed=allowed, visible=visible,
                                by_minimum=best, median_per_round=median, target=target)
    FIGURES[f"{name} L={n} ({kernel})"] = (
        f"{best:.3f} by minimum, {median:.3f} median per round (target <= {target:.3f}; "
        f"pairs allowed {allowed:.1%}, tiles visible on a {config[0]}x{config[1]} grid "
        f"{visible:.1%})")


def _grid() -> tuple[int, int]:
    """The grid numpy_fast reads masks on (``Config.mask_step`` x ``mask_chunk``)."""
    from portattn_numpy import configured

    with configured() as config:
        return config.mask_step, config.mask_chunk


@pytest.mark.benchmark(group="masks on numpy")
@pytest.mark.parametrize("n", [4096, 16384])
def test_packed_documents_in_turns(n: int, in_turns: Any, benchmark: Any) -> None:
    ids, allowed = packed_ids(n)
    mask = masks.causal() & masks.documents(ids)
    _measure(in_turns, benchmark, "packed documents", n, mask, allowed, 0.25)


@pytest.mark.benchmark(group="masks on numpy")
def test_window_or_global_tokens_in_turns(in_turns: Any, benchmark: Any) -> None:
    n = 16384
    mask, allowed = _window_and_globals(n)
    _measure(in_turns, benchmark, "sliding_window(512) | global_tokens(16)", n, mask,
             allowed, allowed + 0.10)


@pytest.mark.benchmark(group="masks on numpy")
def test_window_or_global_tokens_through_block_form_in_turns(in_turns: Any,
                                                             benchmark: Any) -> None:
    n = 16384
    mask, allowed = _window_and_globals(n)
    _measure(in_turns, benchmark, "sliding_window(512) | global_tokens(16) through the "
             "union's block form", n, mask, allowed, allowed + 0.10,
             split_global_tokens=False)


@pytest.mark.benchmark(group="masks on numpy")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
@pytest.mark.parametrize("n", [4096, 16384])
def test_packed_documents_against_flex_attention(n: int, in_turns: Any,
                                                 benchmark: Any) -> None:
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    ids, allowed = packed_ids(n)
    q, k, v = _inputs(n)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    doc = torch.from_numpy(ids[0])

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    block_mask = flex.create_block_mask(mask_mod, 1, None, n, n, device="cpu")
    # a static compile per length: recompiling one for a new length (dynamic shapes)
    # fails in inductor's CPU flex template (torch 2.13)
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    want = compiled(tq, tk, tv, block_mask=block_mask)  # compiled once, here
    mask = masks.causal() & masks.documents(ids)
    np.testing.assert_allclose(portattn.attention(q, k, v, mask=mask), want.numpy(),
                               rtol=1e-4, atol=1e-4)
    kernel = portattn.explain(q, k, v, mask=mask).kernel.name
    best, median = in_turns(lambda: portattn.attention(q, k, v, mask=mask),
                            lambda: compiled(tq, tk, tv, block_mask=block_mask), ROUNDS[n])
    benchmark.extra_info.update(n=n, kernel=kernel, allowed=allowed, by_minimum=best,
                                median_per_round=median, target=1.0)
    FIGURES[f"packed documents L={n} ({kernel}) over compiled FlexAttention"] = (
        f"{best:.3f} by minimum, {median:.3f} median per round (target <= 1.0)")
