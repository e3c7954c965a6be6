"""Score changes (portattn.scores) on every backend, against a float64 textbook.

The textbook builds the change's entries pair by pair (a scalar T5 bucketing, a plain
lookup in the pair table), runs the float64 oracle with them as a dense bias, and sums
each pair's score gradient ``dS = P * (dP - Delta)`` into the table entry it came from
with ``np.add.at``: none of it shares code with the kernels' tile-wise path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import portattn
from portattn import masks, scores
from portattn.autograd import flash_backward, flash_forward
from portattn.kernel import describe
from portattn.testing import assert_close, oracle, to_numpy
from portattn.testing.plugin import require_backend

B, H, HKV, LQ, LK, D = 2, 4, 2, 37, 45, 8
CLASSES_Q, CLASSES_K = 3, 5


def t5_bucket(relative: int, bidirectional: bool, buckets: int, max_distance: int) -> int:
    """T5's bucket of one distance, written out (float32 logarithm, as T5's code)."""
    n, bucket = buckets, 0
    if bidirectional:
        n //= 2
        bucket = n if relative > 0 else 0
        distance = abs(relative)
    else:
        distance = max(-relative, 0)
    exact = n // 2
    if distance < exact:
        return bucket + distance
    ratio = np.float32(distance) / np.float32(exact)
    grown = np.float32(np.log(ratio)) / np.float32(math.log(max_distance / exact)) * (n - exact)
    return bucket + min(exact + int(np.float32(grown)), n - 1)


def test_buckets_follow_the_formula():
    relative = np.arange(-300, 300)
    for bidirectional in (True, False):
        for buckets, max_distance in ((32, 128), (16, 40), (6, 7)):
            got = scores.t5_buckets(np, relative, bidirectional=bidirectional,
                                    num_buckets=buckets, max_distance=max_distance)
            want = [t5_bucket(int(r), bidirectional, buckets, max_distance) for r in relative]
            assert got.tolist() == want, (bidirectional, buckets, max_distance)


class Case:
    """One call: the change's kind and the mask, its arrays built on a backend."""

    def __init__(self, kind: str, mask: str) -> None:
        self.kind, self.mask = kind, mask
        rng = np.random.default_rng(len(kind) * 7 + len(mask))
        self.q = rng.standard_normal((B, H, LQ, D))
        self.k = rng.standard_normal((B, HKV, LK, D))
        self.v = rng.standard_normal((B, HKV, LK, D))
        self.relative = rng.standard_normal((16, H))
        self.pair = rng.standard_normal((CLASSES_Q, CLASSES_K, H))
        self.slopes = rng.uniform(0.05, 0.5, H)
        self.query_classes = rng.integers(0, CLASSES_Q, (B, LQ))
        self.key_classes = rng.integers(0, CLASSES_K, (1, LK))  # broadcast over the batch
        self.segments = np.sort(rng.integers(0, 3, (B, LK)), axis=-1)

    def __repr__(self) -> str:
        return f"{self.kind}-{self.mask}"

    def change(self, backend, dtype="float64"):
        relative = scores.relative_position(backend.asarray(self.relative, dtype),
                                            bidirectional=self.kind != "causal_buckets",
                                            max_distance=20)
        pair = scores.pair_table(backend.asarray(self.pair, dtype),
                                 backend.asarray(self.query_classes),
                                 backend.asarray(self.key_classes))
        if self.kind == "slopes":
            return scores.alibi(backend.asarray(self.slopes, dtype))
        return {"buckets": relative, "causal_buckets": relative, "pair": pair,
                "sum": relative + pair}[self.kind]

    def mask_of(self, backend):
        if self.mask == "none":
            return None
        if self.mask == "causal":
            return masks.causal()
        if self.mask == "window":
            return masks.sliding_window(6, 2)
        segments = backend.asarray(self.segments)
        return masks.documents(segments[..., LK - LQ:], segments) & masks.causal()

    def entries(self) -> np.ndarray:
        """The change's entries, pair by pair."""
        out = np.zeros((B, H, LQ, LK))
        for b, h, i, j in np.ndindex(B, H, LQ, LK):
            if self.kind in ("buckets", "causal_buckets", "sum"):
                bucket = t5_bucket(j - (i + LK - LQ), self.kind != "causal_buckets", 16, 20)
                out[b, h, i, j] += self.relative[bucket, h]
            if self.kind in ("pair", "sum"):
                out[b, h, i, j] += self.pair[self.query_classes[b, i], self.key_classes[0, j], h]
            if self.kind == "slopes":
                out[b, h, i, j] -= self.slopes[h] * abs(i + LK - LQ - j)
        return out

    def table_gradients(self, ds: np.ndarray) -> list[np.ndarray]:
        """Each pair's score gradient summed into the entry it came from."""
        grads = []
        if self.kind in ("buckets", "causal_buckets", "sum"):
            g = np.zeros_like(self.relative)
            for b, h, i, j in np.ndindex(*ds.shape):
                bucket = t5_bucket(j - (i + LK - LQ), self.kind != "causal_buckets", 16, 20)
                np.add.at(g, (bucket, h), ds[b, h, i, j])
            grads.append(g)
        if self.kind in ("pair", "sum"):
            g = np.zeros_like(self.pair)
            for b, h, i, j in np.ndindex(*ds.shape):
                np.add.at(g, (self.query_classes[b, i], self.key_classes[0, j], h),
                          ds[b, h, i, j])
            grads.append(g)
        if self.kind == "slopes":
            g = np.zeros_like(self.slopes)
            for b, h, i, j in np.ndindex(*ds.shape):
                g[h] -= ds[b, h, i, j] * abs(i + LK - LQ - j)
            grads.append(g)
        return grads


CASES = [Case(kind, mask) for kind, mask in (
    ("buckets", "none"), ("causal_buckets", "causal"), ("pair", "window"),
    ("slopes", "window"), ("sum", "documents"), ("sum", "causal"))]


def textbook(case: Case, backend, dout: np.ndarray, dlse: np.ndarray):
    """float64 ``(out, lse, table gradients)`` with the entries as a dense bias."""
    mask = case.mask_of(require_backend("numpy")) if case.mask == "documents" else (
        case.mask_of(backend))
    out, lse, p = oracle(case.q, case.k, case.v, mask=mask, bias=case.entries())
    v = np.repeat(case.v, H // HKV, axis=1)
    dp = dout @ np.swapaxes(v, -1, -2)
    delta = (dout * out).sum(-1, keepdims=True) - dlse[..., None]
    ds = p * (dp - delta)
    return out, lse, case.table_gradients(ds)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_forward_and_table_gradients_match_the_textbook(case, backend):
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    q, k, v = (backend.asarray(a, "float64") for a in (case.q, case.k, case.v))
    change = case.change(backend)
    inputs = describe(q, k, v, mask=case.mask_of(backend), score_mod=change, return_lse=True)
    out, lse = flash_forward(inputs)
    rng = np.random.default_rng(1)
    dout, dlse = rng.standard_normal((B, H, LQ, D)), rng.standard_normal((B, H, LQ))
    want_out, want_lse, want_tables = textbook(case, backend, dout, dlse)
    assert_close(out, want_out, "float64")
    assert_close(lse, want_lse, "float64", "lse")
    grads = flash_backward(inputs, out, lse, backend.asarray(dout, "float64"),
                           backend.asarray(dlse, "float64"))
    tables = [g for g, t in zip(grads.score_mod, change.trainable, strict=True) if t]
    assert [g is None for g in grads.score_mod] == [not t for t in change.trainable]
    assert len(tables) == len(want_tables)
    for got, want in zip(tables, want_tables, strict=True):
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-10, atol=1e-10)
    # the reference kernel, which builds the whole score matrix, agrees
    ref = portattn.attention(q, k, v, mask=case.mask_of(backend), score_mod=change,
                             kernel="reference")
    assert_close(ref, want_out, "float64")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_half_and_single_precision_follow_the_float64_answer(dtype, backend):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    case = CASES[-1]
    q, k, v = (backend.asarray(a, dtype) for a in (case.q, case.k, case.v))
    out = portattn.attention(q, k, v, mask=case.mask_of(backend),
                             score_mod=case.change(backend, "float32"))
    want, _, _ = oracle(case.q, case.k, case.v, mask=case.mask_of(backend),
                        bias=case.entries())
    assert_close(out, want, dtype)


def test_torch_autograd_gives_the_tables_gradients_bitwise_run_to_run():
    torch = require_backend("torch").xp
    case = CASES[-2]
    got = []
    for _ in range(2):
        q, k, v, relative, pair = (torch.asarray(a, requires_grad=True) for a in (
            case.q, case.k, case.v, case.relative, case.pair))
        change = (scores.relative_position(relative, max_distance=20)
                  + scores.pair_table(pair, torch.asarray(case.query_classes),
                                      torch.asarray(case.key_classes)))
        segments = torch.asarray(case.segments)
        mask = masks.documents(segments[..., LK - LQ:], segments) & masks.causal()
        out, lse = portattn.attention(q, k, v, mask=mask, score_mod=change, return_lse=True)
        assert portattn.explain(q, k, v, mask=mask, score_mod=change).kernel.name == "tiled"
        rng = np.random.default_rng(1)
        dout, dlse = rng.standard_normal((B, H, LQ, D)), rng.standard_normal((B, H, LQ))
        torch.autograd.backward((out, lse), (torch.asarray(dout), torch.asarray(dlse)))
        _, _, want = textbook(case, require_backend("torch"), dout, dlse)
        np.testing.assert_allclose(relative.grad.numpy(), want[0], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(pair.grad.numpy(), want[1], rtol=1e-10, atol=1e-10)
        got.append((relative.grad.numpy().tobytes(), pair.grad.numpy().tobytes()))
    assert got[0] == got[1]


def test_jax_jit_grad_gives_the_tables_gradients():
    jax_backend = require_backend("jax")
    import jax

    jnp = jax_backend.xp
    case = CASES[1]
    rng = np.random.default_rng(1)
    dout = rng.standard_normal((B, H, LQ, D))

    def loss(q, k, v, relative):
        change = scores.relative_position(relative, bidirectional=False, max_distance=20)
        out = portattn.attention(q, k, v, mask=masks.causal(), score_mod=change)
        return jnp.sum(out * jnp.asarray(dout))

    arrays = [jnp.asarray(a) for a in (case.q, case.k, case.v, case.relative)]
    grad = jax.jit(jax.grad(loss, argnums=3))(*arrays)
    _, _, want = textbook(case, jax_backend, dout, np.zeros((B, H, LQ)))
    np.testing.assert_allclose(np.asarray(grad), want[0], rtol=1e-10, atol=1e-10)


def test_kernels_without_score_changes_say_so():
    q = np.zeros((1, 2, 8, 4))
    change = scores.relative_position(np.zeros((8, 2)), max_distance=8)
    plan = portattn.explain(q, q, q, score_mod=change)
    assert plan.kernel.kernel.score_mod, str(plan)
    refusing = [e.name for e, why in plan.candidates if "score_mod not supported" in why]
    assert "example_einsum" in refusing, str(plan)  # tests/example_plugin takes none
    assert "score_mod=relative_position(table(8, 2)" in str(plan)


@pytest.mark.parametrize(("make", "error", "says"), [
    (lambda: scores.relative_position(np.zeros((2, 2))), ValueError, "at least 4 buckets"),
    (lambda: scores.relative_position(np.zeros((32, 2)), max_distance=8), ValueError,
     "max_distance must be an int above the exact buckets (8)"),
    (lambda: scores.relative_position(np.zeros((32, 3))), ValueError,
     "(num_buckets, 2); got table.shape=(32, 3)"),
    (lambda: scores.relative_position(np.zeros((32, 2), dtype=np.int64)), TypeError,
     "must have a real floating dtype"),
    (lambda: scores.pair_table(np.zeros((2, 2, 2)), np.zeros((1, 8), dtype=np.int64),
                               np.full((1, 8), 2)), ValueError,
     "key_classes must lie in [0, 2)"),
    (lambda: scores.pair_table(np.zeros((2, 2, 2)), np.zeros((1, 7), dtype=np.int64),
                               np.zeros((1, 8), dtype=np.int64)), ValueError,
     "query_classes must have shape (*batch, L) = (1, 8)"),
    (lambda: scores.pair_table(np.zeros((2, 2, 2)), np.zeros((1, 8)),
                               np.zeros((1, 8), dtype=np.int64)), TypeError,
     "query_classes must be integers"),
    (lambda: "a bias", TypeError, "score_mod must be a portattn.scores change"),
    (lambda: scores.window_table(np.zeros((9, 2)), (2, 3)), ValueError,
     "(2 * Wh - 1) * (2 * Ww - 1) = 15 rows for window=(2, 3); got table.shape[0]=9"),
    (lambda: scores.window_table(np.zeros((9, 2)), (2, 0)), ValueError,
     "window must be a pair of positive ints"),
    (lambda: scores.alibi(np.zeros((3,))), ValueError,
     "alibi slopes must have shape (Hq,) = (2,); got slopes.shape=(3,)"),
])
def test_bad_changes_are_refused_by_name(make, error, says):
    q = np.zeros((1, 2, 8, 4))
    with pytest.raises(error) as raised:
        portattn.attention(q, q, q, score_mod=make())
    assert says in str(raised.value)


def test_softcap_sinks_and_dropout_compose(backend):
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    case = CASES[-1]
    q, k, v = (backend.asarray(a, "float64") for a in (case.q, case.k, case.v))
    sinks = np.linspace(-1.0, 1.0, H)
    out = portattn.attention(q, k, v, mask=masks.causal(), score_mod=case.change(backend),
                             softcap=3.0, sinks=backend.asarray(sinks, "float64"))
    want, _, _ = oracle(case.q, case.k, case.v, mask=masks.causal(), bias=case.entries(),
                        softcap=3.0, sinks=sinks)
    assert_close(out, want, "float64")
    # dropout draws the same pairs on both portable kernels (one hash of the seed)
    dropped = [portattn.attention(q, k, v, mask=masks.causal(), score_mod=case.change(backend),
                                  dropout_p=0.3, dropout_seed=7, kernel=name)
               for name in ("tiled", "reference")]
    np.testing.assert_allclose(to_numpy(dropped[0]), to_numpy(dropped[1]), rtol=1e-12,
                               atol=1e-12)


def test_swin_window_table_matches_the_textbook(backend):
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    height, width, windows = 3, 4, 5
    tokens = height * width
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((windows, H, tokens, D)) for _ in range(3))
    table = rng.standard_normal(((2 * height - 1) * (2 * width - 1), H))
    change = scores.window_table(backend.asarray(table, "float64"), (height, width))
    inputs = describe(*(backend.asarray(a, "float64") for a in (q, k, v)), score_mod=change)
    out, lse = flash_forward(inputs)
    # Swin's index: the offsets of the two tokens' rows and columns
    index = np.zeros((tokens, tokens), dtype=int)
    for i, j in np.ndindex(tokens, tokens):
        dy, dx = i // width - j // width, i % width - j % width
        index[i, j] = (dy + height - 1) * (2 * width - 1) + dx + width - 1
    entries = np.moveaxis(table[index], -1, 0)
    want, want_lse, p = oracle(q, k, v, bias=entries)
    assert_close(out, want, "float64")
    assert_close(lse, want_lse, "float64", "lse")
    dout = rng.standard_normal(want.shape)
    ds = p * (dout @ np.swapaxes(v, -1, -2) - (dout * want).sum(-1, keepdims=True))
    expected = np.zeros_like(table)
    for b, h, i, j in np.ndindex(*ds.shape):
        expected[index[i, j], h] += ds[b, h, i, j]
    grads = flash_backward(inputs, out, lse, backend.asarray(dout, "float64"))
    np.testing.assert_allclose(to_numpy(grads.score_mod[0]), expected, rtol=1e-10,
                               atol=1e-10)
    with pytest.raises(ValueError, match="needs Lq = Lk = Wh \\* Ww = 12"):
        portattn.attention(*(backend.asarray(a[..., :5, :], "float64") for a in (q, k, v)),
                           score_mod=change)


def test_show_draws_the_entries_of_one_head():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    case = CASES[-1]
    numpy_backend = require_backend("numpy")
    change = case.change(numpy_backend)
    ax = scores.show(change, LQ, LK, batch=1, head=2, ax=Figure().subplots())
    drawn = ax.get_images()[0].get_array()
    np.testing.assert_allclose(np.asarray(drawn), case.entries()[1, 2])
    with pytest.raises(ValueError, match=r"head must lie in \[0, 4\); got head=4"):
        scores.show(change, LQ, LK, head=4, ax=Figure().subplots())
    with pytest.raises(ValueError, match=r"batch must lie in \[0, 2\); got batch=2"):
        scores.show(change, LQ, LK, batch=2, ax=Figure().subplots())


def test_changes_by_distance_say_their_entries_and_gradients_per_diagonal():
    case = CASES[0]
    slopes = scores.alibi(case.slopes)
    relative = scores.relative_position(case.relative, max_distance=20)
    pair = scores.pair_table(case.pair, case.query_classes, case.key_classes)
    i, j = np.arange(LQ)[:, None], np.arange(LK)[None, :]
    ds = np.random.default_rng(3).standard_normal((B, H, LQ, LK))
    per_diagonal = np.zeros((H, LQ + LK - 1))
    np.add.at(per_diagonal, (slice(None), j - i + LQ - 1), ds.sum(axis=0))
    for change in (relative, slopes, relative + slopes):
        bound = change.bind(np, "cpu", (B,), H, LQ, LK)
        entries = bound.entries(np, 0, LQ, 0, LK, LQ, LK, 4)[0]
        np.testing.assert_array_equal(bound.by_distance(np, LQ, LK)[:, j - i + LQ - 1],
                                      entries)
        want = bound.table_gradients(np, ds, 0, LQ, 0, LK, LQ, LK, np.float64)
        got = bound.distance_gradients(np, per_diagonal, LQ, LK, np.float64)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    for change in (pair, relative + pair):
        assert change.bind(np, "cpu", (B,), H, LQ, LK).by_distance(np, LQ, LK) is None
    assert (relative + pair + slopes).kinds == {"relative_position", "pair_table", "alibi"}
    assert scores.softcap(np.ones(H)).kinds <= scores.KINDS - scores.ADDITIVE_KINDS
