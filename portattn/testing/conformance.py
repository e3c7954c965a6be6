"""The conformance kit: cases generated from a kernel's declared capabilities.

Every case is checked against the float64 NumPy reference. A case is generated only
for what the kernel declares, and a kernel that then rejects its own case fails: a
declared feature must work.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import masks
from .._inputs import describe
from ..kernel import ANY, Kernel
from .oracle import assert_close, oracle

if TYPE_CHECKING:
    from .backends import Backend

__all__ = ["Case", "check_case", "check_kernel", "conformance_cases"]

HEAD_DIMS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Case:
    """One attention call, described as data (built on any backend by :meth:`build`).

    The fields give the name, the input dtype's name, the shapes (``batch``, ``hq``,
    ``hkv``, ``lq``, ``lk``, ``d``, ``dv``), the mask as a tuple of
    ``(kind, *arguments)`` parts that are intersected, and the options; the inputs are
    drawn from ``numpy.random.default_rng(seed)``.

    Example:
        >>> from portattn.testing import Case, get_backend
        >>> case = Case("small", lq=5, lk=7, mask=(("causal", "bottom_right"),))
        >>> str(case)
        'small-float32'
        >>> args, kwargs, np_args, np_kwargs = case.build(get_backend("numpy"))
        >>> [a.shape for a in args]
        [(2, 4, 5, 16), (2, 4, 7, 16), (2, 4, 7, 16)]
        >>> kwargs["mask"]
        causal(bottom_right)
    """

    name: str
    dtype: str = "float32"
    batch: tuple[int, ...] = (2,)
    hq: int = 4
    hkv: int = 4
    lq: int = 33
    lk: int = 33
    d: int = 16
    dv: int = 16
    mask: tuple[tuple[Any, ...], ...] = ()
    bias: str | None = None  # None, "broadcast" (Hq, Lq, Lk) or "full"
    softcap: float | None = None
    alibi: str | None = None  # None, "heads" (Hq,) or "batch_heads" (*batch, Hq)
    sinks: bool = False
    score_mod: str | None = None
    """None, ``"buckets"`` (T5's bidirectional relative positions) or
    ``"buckets_and_pairs"`` (one-directional ones plus a pair table)."""
    scale: float | None = None
    lse: bool = False
    weights: bool = False
    dropout: float = 0.0
    """``dropout_p``, with a seed drawn from the case's ``seed``: the oracle drops the
    same pairs."""
    nan_keys_from: int | None = None
    """Keys from this index on, hidden from every query by the mask, hold NaN in key
    and value for the kernel (the oracle sees them finite): they must not matter."""
    seed: int = 0
    needs: frozenset[str] = field(default=frozenset(), compare=False)

    def __str__(self) -> str:
        return f"{self.name}-{self.dtype}"

    def build(self, backend: Backend) -> tuple[tuple, dict, tuple, dict]:
        """The call's arguments on ``backend``, and the same call on float64 NumPy.

        Args:
            backend: the :class:`~portattn.testing.Backend` to build the arrays on.

        Returns:
            ``(args, kwargs, np_args, np_kwargs)``: ``(query, key, value)`` and the
            keyword arguments of :func:`portattn.attention` on ``backend``, then the
            same on float64 NumPy, holding exactly the values the backend's arrays
            hold (rounded to the case's dtype).
        """
        import numpy as np

        rng = np.random.default_rng(self.seed)
        shapes = ((*self.batch, self.hq, self.lq, self.d), (*self.batch, self.hkv, self.lk, self.d),
                  (*self.batch, self.hkv, self.lk, self.dv))
        raw = [rng.standard_normal(s) for s in shapes]
        arrays = tuple(backend.asarray(r, self.dtype) for r in raw)
        # The oracle sees exactly the rounded inputs the kernel sees.
        np_arrays = tuple(np.asarray(backend.to_numpy(a), dtype=np.float64) for a in arrays)
        if self.nan_keys_from is not None:
            for r in raw[1:]:
                r[..., self.nan_keys_from:, :] = np.nan
            arrays = (arrays[0], *(backend.asarray(r, self.dtype) for r in raw[1:]))
        kwargs = {"scale": self.scale, "softcap": self.softcap, "return_lse": self.lse,
                  "return_weights": self.weights}
        if self.dropout:
            kwargs.update(dropout_p=self.dropout, dropout_seed=1000 + self.seed)
        np_kwargs = dict(kwargs)
        if self.bias is not None:
            shape = (self.hq, self.lq, self.lk) if self.bias == "broadcast" else (
                *self.batch, self.hq, self.lq, self.lk)
            bias = rng.standard_normal(shape) * 0.5
            kwargs["bias"] = backend.asarray(bias, self.dtype)
            np_kwargs["bias"] = np.asarray(backend.to_numpy(kwargs["bias"]), dtype=np.float64)
        per_head = {"heads": (self.hq,), "batch_heads": (*self.batch, self.hq)}
        for name, shape, low, high in (("alibi_slopes", per_head.get(self.alibi), 0.02, 0.6),
                                       ("sinks", (self.hq,) if self.sinks else None, -1.0, 2.0)):
            if shape is not None:
                kwargs[name] = backend.asarray(rng.uniform(low, high, shape), self.dtype)
                np_kwargs[name] = np.asarray(backend.to_numpy(kwargs[name]), dtype=np.float64)
        if self.mask:
            kwargs["mask"] = self._mask(backend.asarray)
            np_kwargs["mask"] = self._mask(np.asarray)
        if self.score_mod is not None:
            tables = (rng.standard_normal((16, self.hq)),
                      rng.standard_normal((3, 4, self.hq)))
            classes = (rng.integers(0, 3, (*self.batch, self.lq)),
                       rng.integers(0, 4, (*self.batch, self.lk)))
            on_backend = [backend.asarray(t, self.dtype) for t in tables]
            as_given = [np.asarray(backend.to_numpy(t), dtype=np.float64) for t in on_backend]
            kwargs["score_mod"] = self._score_mod(on_backend, [backend.asarray(c)
                                                               for c in classes])
            np_kwargs["score_mod"] = self._score_mod(as_given, list(classes))
        return arrays, kwargs, np_arrays, np_kwargs

    def _score_mod(self, tables: list[Any], classes: list[Any]) -> Any:
        from .. import scores

        if self.score_mod == "buckets":
            return scores.relative_position(tables[0], max_distance=24)
        if self.score_mod == "learned_softcap":  # a cap in [1, 2) per head
            column = tables[0][0, :]
            return scores.softcap(1.0 + column * column / (1.0 + column * column))
        if self.score_mod == "function":
            from array_api_compat import array_namespace

            weight = array_namespace(tables[0]).reshape(tables[0][:1, :1], ())
            return scores.function(_tilted, (weight,))
        return (scores.relative_position(tables[0], bidirectional=False, max_distance=24)
                + scores.pair_table(tables[1], *classes))

    def _mask(self, convert: Any) -> masks.Mask:
        import numpy as np

        rng = np.random.default_rng(self.seed + 1)  # same draws for backend and oracle
        mask = None
        for spec in self.mask:
            part = self._part(spec, convert, rng)
            mask = part if mask is None else mask & part
        return mask

    def _part(self, spec: tuple[Any, ...], convert: Any, rng: Any) -> masks.Mask:
        import numpy as np

        kind, *args = spec
        if kind in ("causal", "sliding_window", "sink_tokens", "chunks"):
            return getattr(masks, kind)(*args)
        if kind in ("key_lengths", "query_lengths", "prefix"):
            lengths = np.asarray(args[0], dtype=np.int64).reshape(self.batch)
            return getattr(masks, kind)(convert(lengths))
        if kind == "dense":
            allowed = rng.random((*self.batch, self.hq, self.lq, self.lk)) < args[0]
            return masks.dense(convert(allowed))
        if kind in ("key_ranges", "query_ranges"):
            start, stop = (convert(self._per_batch(a)) for a in args)
            return getattr(masks, kind)(start, stop)
        if kind == "sequence_window":
            left, right, q_lengths, k_lengths = args
            return masks.sequence_window(
                left, right, query_lengths=convert(self._per_batch(q_lengths)),
                key_lengths=convert(self._per_batch(k_lengths)))
        if kind == "documents":
            ids = np.asarray(args[0], dtype=np.int64).reshape(*self.batch, self.lq)
            return masks.documents(convert(ids))
        if kind == "global_tokens":
            positions = np.asarray(args[0], dtype=np.int64)
            return masks.global_tokens(convert(positions.reshape(*self.batch, -1)
                                               if positions.ndim > 1 else positions))
        if kind == "block_layout":
            density, block = args
            rows = cols = -(-self.lk // block)
            layout = rng.random((self.hq, rows, cols)) < density
            return masks.block_layout(convert(layout), block)
        if kind == "function":
            return masks.function(MASK_FUNCTIONS[args[0]], args=())  # of the indices alone
        if kind == "union":
            union = None
            for member in args:
                part = self._part(member, convert, rng)
                union = part if union is None else union | part
            return union
        msg = f"unknown mask kind in a conformance case: {kind!r}"
        raise ValueError(msg)

    def _per_batch(self, values: tuple[int, ...]) -> Any:
        import numpy as np

        return np.asarray(values, dtype=np.int64).reshape(self.batch)


def _chunked_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
    return (q >= k) & (q // 8 == k // 8)


def _per_batch_and_head(b: Any, h: Any, q: Any, k: Any) -> Any:
    return ((q - k) % (h + 2) == 0) | (k < 3 + 4 * b)


def _tilted(score: Any, b: Any, h: Any, q: Any, k: Any, weight: Any) -> Any:
    """A score function of the cases: a tilt by distance, steeper for later heads and
    batch elements, times a learned 0-d ``weight``; elementwise (each score from its
    own indices, as FlexAttention calls it one score at a time) and written against the
    array API, so the same function runs on every library."""
    from array_api_compat import array_namespace

    xp = array_namespace(score)
    return score + weight * xp.astype((h + b + 1) * (q - k), score.dtype) / 16


#: Mask functions of the conformance cases: written with operators only, so the same
#: function runs on every library.
MASK_FUNCTIONS = {"chunked_causal": _chunked_causal, "per_batch_and_head": _per_batch_and_head}


def _lengths(n: int, values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(values[i % len(values)] for i in range(n))


def conformance_cases(kernel: type[Kernel] | Kernel) -> list[Case]:
    """Cases for everything ``kernel`` declares, and nothing it does not.

    Args:
        kernel: a :class:`~portattn.kernel.Kernel` subclass or instance.

    Returns:
        A list of :class:`Case`: every case in the kernel's first dtype (float32 where
        declared), and a sample of them in each other dtype it declares.

    Example:
        >>> import portattn
        >>> from portattn.testing import conformance_cases
        >>> tiled = next(e.kernel for e in portattn.kernels() if e.name == "tiled")
        >>> [str(case) for case in conformance_cases(tiled)[:3]]
        ['basic-float32', 'cross_short_queries-float32', 'cross_long_queries-float32']
    """
    k = kernel if isinstance(kernel, type) else type(kernel)
    lse = k.returns_lse
    base = Case("basic", lse=lse)
    cases = [
        base,
        replace(base, name="cross_short_queries", lq=5, lk=47),
        replace(base, name="cross_long_queries", lq=47, lk=9),
        replace(base, name="single_token", lq=1, lk=1),
        replace(base, name="decode_step", lq=1, lk=40),
        replace(base, name="two_batch_dims", batch=(2, 3), hq=2, hkv=2, lq=11, lk=13),
        replace(base, name="no_batch_dims", batch=(), lq=19, lk=21),
        replace(base, name="custom_scale", scale=0.3),
    ]
    low, high = k.head_dim
    dims = [d for d in HEAD_DIMS if d >= low and (high is None or d <= high)]
    for d in sorted({dims[0], dims[-1], *(d for d in dims if d == 64)}) if dims else ():
        cases.append(replace(base, name=f"head_dim_{d}", d=d, dv=d, lq=17, lk=23))
    cases = [replace(c, d=max(c.d, low), dv=max(c.dv, low)) for c in cases]
    if k.gqa:
        cases += [replace(base, name="grouped_query", hq=6, hkv=2),
                  replace(base, name="multi_query", hq=4, hkv=1, lq=9, lk=30)]
    if k.value_head_dim:
        cases.append(replace(base, name="value_head_dim", d=max(16, low), dv=max(24, low)))
    cases += _mask_cases(k, base)
    if k.bias:
        cases += [replace(base, name="bias_broadcast", bias="broadcast"),
                  replace(base, name="bias_full", bias="full", lq=9, lk=30)]
        if "causal" in k.masks:
            cases.append(replace(base, name="bias_and_causal", bias="broadcast",
                                 mask=(("causal", "bottom_right"),)))
    if k.softcap:
        cases += [replace(base, name="softcap", softcap=5.0, scale=1.0),
                  replace(base, name="softcap_small", softcap=1.0, lq=9, lk=30)]
    if k.alibi:
        cases += [replace(base, name="alibi", alibi="heads"),
                  replace(base, name="alibi_per_batch_cross", alibi="batch_heads", lq=9, lk=30)]
        if "causal" in k.masks:
            cases.append(replace(base, name="alibi_causal", alibi="heads",
                                 mask=(("causal", "bottom_right"),)))
    if _takes_scores(k, "relative_position"):
        cases.append(replace(base, name="score_mod_buckets", score_mod="buckets", lq=9,
                             lk=30))
        if "causal" in k.masks and _takes_scores(k, "relative_position", "pair_table"):
            cases.append(replace(base, name="score_mod_causal_pairs",
                                 score_mod="buckets_and_pairs",
                                 mask=(("causal", "bottom_right"),)))
    if k.score_functions:
        cases.append(replace(base, name="score_mod_learned_softcap",
                             score_mod="learned_softcap", scale=1.0))
        if "causal" in k.masks:
            cases.append(replace(base, name="score_mod_function", score_mod="function",
                                 lq=9, lk=30, mask=(("causal", "bottom_right"),)))
    if k.sinks:
        cases.append(replace(base, name="sinks", sinks=True))
        if "causal" in k.masks:  # rows that see no key: output 0, lse = the sink
            cases.append(replace(base, name="sinks_fully_masked_rows", sinks=True, lq=40, lk=9,
                                 mask=(("causal", "bottom_right"),)))
        if k.gqa:
            cases.append(replace(base, name="sinks_grouped_query", sinks=True, hq=6, hkv=2))
    if k.returns_weights:
        cases += [replace(base, name="weights", weights=True)]
        if "causal" in k.masks:
            cases.append(replace(base, name="weights_causal", weights=True,
                                 mask=(("causal", "bottom_right"),)))
    if k.dropout_seed:
        cases.append(replace(base, name="dropout", dropout=0.3))
        if k.gqa and "causal" in k.masks:
            cases.append(replace(base, name="dropout_grouped_causal", dropout=0.5, hq=6,
                                 hkv=2, lq=20, lk=35, mask=(("causal", "bottom_right"),)))
        if "documents" in k.masks:
            cases.append(replace(base, name="dropout_documents", dropout=0.1, mask=(
                ("documents", [0] * 10 + [1] * 15 + [2] * 8 + [0] * 20 + [1] * 13),)))
        if k.returns_weights:
            cases.append(replace(base, name="dropout_weights", dropout=0.3, weights=True))
    if k.empty:
        cases += [replace(base, name="no_keys", lk=0), replace(base, name="no_queries", lq=0)]
    primary = "float32" if "float32" in k.dtypes else sorted(k.dtypes)[0] if k.dtypes else None
    if primary is None:
        return []
    out = [replace(c, dtype=primary) for c in cases]
    sampler = {"basic", "causal_bottom_right", "grouped_query", "key_lengths", "softcap",
               "dropout"}
    for dtype in sorted(k.dtypes - {primary}):
        out += [replace(c, dtype=dtype) for c in cases if c.name in sampler]
    return out


def _mask_cases(k: type[Kernel], base: Case) -> list[Case]:
    declared = k.masks
    cases = []

    def kinds_of(parts: tuple[tuple[Any, ...], ...]) -> set[str]:
        kinds = set()
        for kind, *args in parts:
            kinds.add(kind)
            if kind == "sequence_window":  # it comes with the lengths it is aligned to
                kinds |= {"query_lengths", "key_lengths"}
            if kind == "union":
                kinds |= kinds_of(tuple(args))
        return kinds

    def add(name: str, *parts: tuple[Any, ...], **changes: Any) -> None:
        if kinds_of(parts) <= declared:
            cases.append(replace(base, name=name, mask=parts, **changes))

    br, tl = ("causal", "bottom_right"), ("causal", "top_left")
    add("causal_bottom_right", br)
    add("causal_bottom_right_cross", br, lq=9, lk=40)
    add("causal_bottom_right_fully_masked_rows", br, lq=40, lk=9)
    add("causal_top_left", tl)
    add("causal_top_left_cross", tl, lq=9, lk=40)
    add("causal_top_left_long_queries", tl, lq=40, lk=9)
    add("window_left", ("sliding_window", 4, 0))
    add("window_both_sides", ("sliding_window", 3, 2))
    add("window_cross", ("sliding_window", 5, 1), lq=10, lk=40)
    add("window_unbounded_left", ("sliding_window", None, 2))
    add("key_lengths", ("key_lengths", _lengths(2, (20, 0))))
    add("key_lengths_full", ("key_lengths", _lengths(2, (33, 1))))
    add("query_lengths", ("query_lengths", _lengths(2, (33, 7))))
    add("dense", ("dense", 0.7))
    add("dense_sparse", ("dense", 0.05))
    add("causal_and_key_lengths", br, ("key_lengths", _lengths(2, (25, 12))))
    add("window_and_lengths", ("sliding_window", 6, 0), ("key_lengths", (30, 17)),
        ("query_lengths", (33, 20)))
    add("causal_and_dense", tl, ("dense", 0.6))
    if k.gqa:
        add("grouped_query_causal", br, hq=6, hkv=2, lq=20, lk=35)
    add("key_ranges_left_padding", ("key_ranges", (5, 0), (33, 33)))
    add("key_ranges", ("key_ranges", (3, 10), (20, 33)))
    add("query_ranges", ("query_ranges", (0, 4), (33, 20)))
    add("sequence_causal", ("sequence_window", None, 0, (9, 20), (40, 25)), lq=20, lk=40)
    add("sequence_window", ("sequence_window", 6, 0, (33, 12), (33, 30)))
    add("documents", ("documents", [0] * 10 + [1] * 15 + [2] * 8 + [0] * 20 + [1] * 10
                      + [-1] * 3))
    add("documents_causal", tl, ("documents", [0] * 16 + [1] * 17 + [5] * 33))
    # The sparse patterns of long-context models (with the block form, a kernel that
    # takes one takes them all).
    add("prefix_lm", ("union", br, ("prefix", _lengths(2, (12, 0)))))
    add("sink_tokens_and_window", br, ("union", ("sliding_window", 4, 0), ("sink_tokens", 3)))
    add("global_tokens_and_window", ("union", ("sliding_window", 3, 3),
                                     ("global_tokens", (0, 17, -1))))
    add("global_tokens_per_batch", ("global_tokens", (5, -1, 30, 2)))
    add("global_tokens_cross", ("union", br, ("global_tokens", (39,))), lq=9, lk=40)
    add("chunks_causal", br, ("chunks", 8))
    add("chunks_cross", ("chunks", 16), lq=10, lk=40)
    add("block_layout", ("block_layout", 0.4, 8))
    add("block_layout_cross_causal", br, ("block_layout", 0.5, 16), lq=20, lk=40)
    add("function", ("function", "chunked_causal"))
    add("function_per_batch_and_head", ("function", "per_batch_and_head"), lq=20, lk=37)
    add("union_of_documents_and_sinks", ("union", ("documents", [0] * 10 + [1] * 23 + [2] * 33),
                                         ("sink_tokens", 2)))
    if not k.finite_inputs_only:  # dispatch checks the answers of the others
        add("nan_past_key_lengths", ("key_lengths", (20, 20)), nan_keys_from=20)
        add("nan_keys_no_query_sees", tl, lq=9, lk=40, nan_keys_from=9)
    return cases


def _takes_scores(k: type[Kernel], *kinds: str) -> bool:
    """Whether ``k`` takes score changes of all ``kinds`` (``Kernel.score_mod``)."""
    return k.score_mod is True or (bool(k.score_mod) and set(kinds) <= k.score_mod)


def _skip_reason(k: type[Kernel], case: Case, backend: Backend) -> str | None:
    if case.dtype not in backend.dtypes:
        return f"{backend.name} has no {case.dtype}"
    if k.namespaces != ANY and backend.namespace not in k.namespaces:
        return f"{k.name} does not run on {backend.namespace}"
    if k.devices != ANY and backend.device_kind not in k.devices:
        return f"{k.name} does not run on {backend.device_kind}"
    why = k.available()
    return None if why is None else f"{k.name} unavailable: {why}"


def check_case(kernel: type[Kernel] | Kernel, case: Case, backend: Backend) -> None:
    """Run ``case`` through ``kernel`` on ``backend`` and compare with the reference.

    Skips (pytest) when the kernel does not target the backend, lacks the case's dtype
    there or is unavailable; fails when the kernel rejects a case built from its own
    declarations or gets it wrong.

    Args:
        kernel: a :class:`~portattn.kernel.Kernel` subclass or instance.
        case: one of :func:`conformance_cases`.
        backend: the :class:`~portattn.testing.Backend` to run on.

    Raises:
        AssertionError: a result differs from the reference (:func:`assert_close`),
            is missing, or has the wrong dtype.

    Example:
        >>> import portattn
        >>> from portattn.testing import check_case, conformance_cases, get_backend
        >>> tiled = next(e.kernel for e in portattn.kernels() if e.name == "tiled")
        >>> for case in conformance_cases(tiled)[:5]:
        ...     check_case(tiled, case, get_backend("numpy"))
    """
    import pytest

    instance = kernel if isinstance(kernel, Kernel) else kernel()
    k = type(instance)
    skip = _skip_reason(k, case, backend)
    if skip is not None:
        pytest.skip(skip)
    args, kwargs, np_args, np_kwargs = case.build(backend)
    inputs = describe(*args, **kwargs)
    reasons = k.not_supported_reasons(inputs)
    if reasons:
        pytest.fail(f"{k.name} rejects case {case} built from its declarations: "
                    + "; ".join(reasons))
    out, lse, weights = instance.run(inputs)
    want_out, want_lse, want_weights = oracle(*np_args, **np_kwargs)
    assert_close(out, want_out, case.dtype, "out")
    if case.lse:
        assert lse is not None, f"{k.name} returned no lse although asked"
        assert_close(lse, want_lse, case.dtype, "lse")
    if case.weights:
        assert weights is not None, f"{k.name} returned no weights although asked"
        assert_close(weights, want_weights, case.dtype, "weights")
    out_dtype = str(out.dtype).rsplit(".", 1)[-1]
    assert out_dtype == case.dtype, f"out dtype {out_dtype} != input dtype {case.dtype}"


def check_kernel(kernel: type[Kernel] | Kernel, backend: Backend) -> None:
    """Every conformance case of ``kernel`` on ``backend`` (cases that do not apply are
    skipped).

    Args:
        kernel: a :class:`~portattn.kernel.Kernel` subclass or instance.
        backend: the :class:`~portattn.testing.Backend` to run on.

    Raises:
        AssertionError: one, listing every case that failed.

    Example:
        >>> import portattn
        >>> from portattn.testing import check_kernel, get_backend
        >>> tiled = next(e.kernel for e in portattn.kernels() if e.name == "tiled")
        >>> check_kernel(tiled, get_backend("numpy"))
    """
    import pytest

    failures = []
    for case in conformance_cases(kernel):
        try:
            check_case(kernel, case, backend)
        except pytest.skip.Exception:
            continue
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(f"{case}: {e}")
    assert not failures, "\n".join(failures)
