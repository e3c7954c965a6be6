"""A layer serving from a paged cache: packed passes that mix prompts, prompt chunks and
decode steps of several sequences give each sequence the rows of its own causal pass;
bad combinations are named."""

from __future__ import annotations

import numpy as np
import pytest

from portattn import PagedStep, masks
from portattn.multihead import MultiHeadAttention
from portattn.testing import assert_close

#: Each pass: (sequence, tokens) packed in this order.
PASSES = [
    [(0, 5), (1, 3)],           # two prompts
    [(0, 1), (1, 1), (2, 4)],   # two decode steps and a third prompt joins
    [(2, 2), (0, 1)],           # a prompt chunk (bottom-right alignment) and a decode
    [(1, 1), (2, 1), (0, 1)],   # decode steps in another order
]


@pytest.mark.parametrize(("num_kv_heads", "layout"), [(4, "blhd"), (2, "bhld"), (1, "blhd")])
def test_packed_passes_equal_each_sequences_causal_pass(backend, num_kv_heads, layout):
    layer = MultiHeadAttention.init(16, 4, num_kv_heads, seed=3, dtype="float64")
    lengths = [sum(n for p in PASSES for s, n in p if s == seq) for seq in range(3)]
    rng = np.random.default_rng(4)
    tokens = [rng.standard_normal((n, 16)) for n in lengths]
    expected = [layer(t[None], mask=masks.causal())[0] for t in tokens]
    on_backend = layer.to(backend.xp, device=backend.device, dtype="float32")
    cache = on_backend.new_paged_cache(page_size=2, num_pages=2, layout=layout)
    sequences = [cache.add() for _ in range(3)]
    done = [0, 0, 0]
    got: list[list[np.ndarray]] = [[], [], []]
    for packed in PASSES:
        rows = [tokens[s][done[s]:done[s] + n] for s, n in packed]
        x = backend.asarray(np.concatenate(rows), "float32")
        step = cache.step([sequences[s] for s, _ in packed], [n for _, n in packed])
        out = backend.to_numpy(on_backend(x, mask=masks.causal(), cache=step))
        assert out.shape == (x.shape[0], 16)
        at = 0
        for s, n in packed:
            got[s].append(out[at:at + n])
            done[s] += n
            at += n
    assert [cache.length(s) for s in sequences] == lengths
    for s in range(3):
        assert_close(np.concatenate(got[s]), expected[s], "float32")


def test_a_step_names_what_it_cannot_take(backend):
    layer = MultiHeadAttention.init(8, 2, xp=backend.xp, device=backend.device)
    cache = layer.new_paged_cache(page_size=4)
    seq = cache.add()
    x = backend.asarray(np.ones((3, 8)), "float32")
    step = cache.step([seq], [3])
    assert isinstance(step, PagedStep)
    with pytest.raises(ValueError, match=r"\(T, d_model\); got x.shape=\(1, 3, 8\)"):
        layer(backend.asarray(np.ones((1, 3, 8)), "float32"), cache=step)
    with pytest.raises(ValueError, match=r"takes no bias"):
        layer(x, cache=step, bias=backend.asarray(np.zeros((2, 3, 3)), "float32"))
    with pytest.raises(ValueError, match=r"got both context and cache"):
        layer(x, context=x, cache=step)
    with pytest.raises(ValueError, match=r"mask must read positions alone"):
        layer(x, mask=masks.key_lengths(backend.asarray(np.array([2]), "int32")), cache=step)
    with pytest.raises(ValueError, match=r"sequence 7 is not in the cache"):
        cache.step([7])
    assert cache.length(seq) == 0  # nothing written by a refused pass
