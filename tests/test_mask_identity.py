"""A mask is what its arrays hold when a call begins (docs/semantics.md, "Identity and
caches"): whatever the caller writes to them afterwards, by any route, and whatever
was cached before, every kernel of every library gives the answer of the values the
call began with, or a clear error. Never a stale block form or table."""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace

import portattn
from portattn import masks
from portattn.errors import KernelNotUsableError
from portattn.kernel import ANY
from portattn.testing import assert_close, oracle

B, HQ, HKV, L, D = 2, 2, 1, 40, 16
rng = np.random.default_rng(7)


def _same_document(b, h, q, k, ids):
    xp = array_namespace(ids)

    def document(i):  # 1-D indices: what every library's take accepts (Dask too)
        return xp.reshape(xp.take(ids, xp.reshape(i, (-1,))), i.shape)

    return document(q) == document(k)


#: name -> (mask of the arrays, the arrays' values before and after a write)
CASES = {
    "key_lengths": (lambda a: masks.key_lengths(a[0]), [[40, 12]], [[9, 33]]),
    "query_lengths": (lambda a: masks.query_lengths(a[0]) & masks.causal(), [[40, 12]],
                      [[5, 40]]),
    "key_ranges": (lambda a: masks.key_ranges(a[0], a[1]), [[3, 0], [30, 40]],
                   [[10, 5], [20, 38]]),
    "documents": (lambda a: masks.documents(a[0]) & masks.causal(),
                  [np.stack([np.arange(L) // 20, np.arange(L) // 13])],
                  [np.stack([np.arange(L) // 7, np.arange(L) // 40])]),
    "global_tokens": (lambda a: masks.global_tokens(a[0]) | masks.sliding_window(2),
                      [[0, 5]], [[17, 30]]),
    "prefix": (lambda a: masks.causal() | masks.prefix(a[0]), [[10, 3]], [[25, 0]]),
    "sequence_causal": (lambda a: masks.sequence_causal(a[0], a[1]), [[40, 20], [40, 30]],
                        [[10, 35], [30, 40]]),
    "block_layout": (lambda a: masks.block_layout(a[0], 8),
                     [rng.random((5, 5)) < 0.5], [rng.random((5, 5)) < 0.5]),
    "dense": (lambda a: masks.dense(a[0]), [rng.random((B, 1, L, L)) < 0.6],
              [rng.random((B, 1, L, L)) < 0.3]),
    "function": (lambda a: masks.function(_same_document, args=(a[0],)),
                 [np.arange(L) // 10], [np.arange(L) // 3]),
}


def _writers(backend):
    """Every route by which a caller can change an array in place, for the backend's
    library: ``name -> write(array, new values as NumPy)``."""
    name = backend.namespace
    if name == "numpy":
        found = {
            "setitem": lambda a, new: a.__setitem__(..., new),
            "through a view": lambda a, new: a.view().__setitem__(..., new),
            "through a memoryview": lambda a, new: np.asarray(memoryview(a)).__setitem__(
                ..., new),
            "np.copyto": lambda a, new: np.copyto(a, new),
        }
        try:
            import torch
        except ImportError:
            return found
        found["torch.from_numpy"] = lambda a, new: torch.from_numpy(a).copy_(
            torch.from_numpy(np.ascontiguousarray(new)))
        return found
    if name == "torch":
        import torch

        def tensor(a, new):
            return torch.as_tensor(np.ascontiguousarray(new), device=a.device)

        return {
            "copy_": lambda a, new: a.copy_(tensor(a, new)),
            "setitem": lambda a, new: a.__setitem__(..., tensor(a, new)),
            ".data": lambda a, new: a.data.copy_(tensor(a, new)),
            ".detach()": lambda a, new: a.detach().copy_(tensor(a, new)),
            ".numpy() view": lambda a, new: a.numpy().__setitem__(..., new),
            "DLPack": lambda a, new: torch.from_dlpack(a).copy_(tensor(a, new)),
            "untyped_storage": lambda a, new: a.untyped_storage().copy_(
                tensor(a, new).untyped_storage()),
            "torch.from_numpy(t.numpy())": lambda a, new: torch.from_numpy(
                a.numpy()).copy_(tensor(a, new)),
        }
    if name in ("array_api_strict", "dask"):
        return {"setitem": lambda a, new: a.__setitem__(..., backend.asarray(new))}
    return {}  # JAX: arrays are immutable


def _kernels(backend):
    return [e.name for e in portattn.kernels() if e.kernel is not None and (
        e.kernel.namespaces == ANY or backend.namespace in e.kernel.namespaces)]


def _qkv(backend):
    return tuple(backend.asarray(rng.standard_normal(s), "float32")
                 for s in ((B, HQ, L, D), (B, HKV, L, D), (B, HKV, L, D)))


def _arrays(backend, values):
    found = []
    for v in values:
        v = np.array(v)  # a copy: writes must not reach CASES
        found.append(backend.asarray(v if v.dtype == bool else v.astype(np.int64)))
    return found


def _check_every_kernel(backend, case, write):
    """Call each kernel, change the arrays with ``write`` (or hand new ones), call it
    again with the same mask object and with a new one: each answer is that of the
    values held when its call began."""
    make, old, new = CASES[case]
    q, k, v = _qkv(backend)
    want_old = oracle(q, k, v, mask=make([np.asarray(a) for a in old]))[0]
    want_new = oracle(q, k, v, mask=make([np.asarray(a) for a in new]))[0]
    ran, failures = [], []
    for name in _kernels(backend):
        arrays = _arrays(backend, old)
        mask = make(arrays)
        try:
            first = portattn.attention(q, k, v, mask=mask, kernel=name)
        except KernelNotUsableError:
            continue
        ran.append(name)
        if write is None:  # the library's way: new arrays, a new mask
            arrays = _arrays(backend, new)
        else:
            for a, values in zip(arrays, new, strict=True):
                write(a, np.asarray(values, dtype=np.asarray(backend.to_numpy(a)).dtype))
        results = [("first call", first, want_old),
                   ("same mask object", portattn.attention(q, k, v, mask=mask, kernel=name),
                    want_new if write is not None else want_old),
                   ("new mask object", portattn.attention(q, k, v, mask=make(arrays),
                                                          kernel=name), want_new)]
        for when, got, want in results:
            try:
                assert_close(got, want, "float32")
            except AssertionError as e:
                failures.append(f"{name}, {when}: {str(e).splitlines()[0]}")
    assert ran, f"no kernel ran {case} on {backend.name}"
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", list(CASES))
def test_every_kind_changed_in_place_between_calls(backend, case):
    writers = _writers(backend)
    if not writers:
        pytest.skip(f"{backend.name} arrays cannot be changed in place")
    _check_every_kernel(backend, case, next(iter(writers.values())))


def test_documents_changed_in_place_by_every_route(backend):
    writers = _writers(backend)
    if not writers:
        pytest.skip(f"{backend.name} arrays cannot be changed in place")
    failures = []
    for route, write in writers.items():
        try:
            _check_every_kernel(backend, "documents", write)
        except AssertionError as e:
            failures.append(f"written by {route}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", list(CASES))
def test_every_kind_with_new_arrays(backend, case):
    _check_every_kernel(backend, case, None)


def test_a_new_function_mask_sees_what_its_function_reads_now(backend):
    # fn reads state the caller changes: nothing may come from the first mask
    q, k, v = _qkv(backend)
    state = {"size": L}

    def same_document(b, h, i, j):
        return i // state["size"] == j // state["size"]

    want = oracle(q, k, v, mask=masks.documents(np.arange(L) // 8))[0]
    ran = []
    for name in _kernels(backend):
        state["size"] = L
        try:
            portattn.attention(q, k, v, mask=masks.function(same_document), kernel=name)
        except KernelNotUsableError:
            continue
        state["size"] = 8
        assert_close(portattn.attention(q, k, v, mask=masks.function(same_document),
                                        kernel=name), want, "float32", what=name)
        ran.append(name)
    assert ran


def test_a_mask_of_equal_content_shares_its_block_form():
    # what makes the rule cheap: equal values, not the same objects
    first = masks.documents(np.arange(L) // 8).bind(np, (B,), HQ, L, L)
    again = masks.documents(np.arange(L) // 8).bind(np, (B,), HQ, L, L)
    other = masks.documents(np.arange(L) // 9).bind(np, (B,), HQ, L, L)
    form = masks.block_mask(first, L, L, 8, 8)
    assert masks.block_mask(again, L, L, 8, 8) is form
    assert masks.block_mask(other, L, L, 8, 8) is not form


def test_a_bound_mask_holds_its_own_copies():
    ids = np.arange(L) // 8
    bound = masks.documents(ids).bind(np, (B,), HQ, L, L)
    ids[:] = 0
    assert np.asarray(bound.query_ids).max() == (L - 1) // 8
    assert masks.documents(ids).content_key() is None  # unbound: the caller's arrays


def test_mask_arrays_from_python_are_moved_to_the_call(backend):
    q, k, v = _qkv(backend)
    want = oracle(q, k, v, mask=masks.key_lengths(np.array([3, 40])) & masks.causal())[0]
    for lengths in ([3, 40], (3, 40), np.array([3, 40])):
        got = portattn.attention(q, k, v, mask=masks.key_lengths(lengths) & masks.causal())
        assert_close(got, want, "float32")


def _gradients(backend, name, make, arrays, qkv, write=None, new=None):
    """``(dq, dk, dv)`` of kernel ``name`` with the mask ``make(arrays)``, its arrays
    written between the forward and the backward when ``write`` is given."""
    import torch

    leaves = [x.detach().clone().requires_grad_(True) for x in qkv]
    out = portattn.attention(*leaves, mask=make(arrays), kernel=name)
    if write is not None:
        for a, values in zip(arrays, new, strict=True):
            write(a, np.asarray(values, dtype=np.asarray(backend.to_numpy(a)).dtype))
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    return torch.autograd.grad((out * weights).sum(), leaves)


@pytest.mark.parametrize("case", ["key_lengths", "documents", "dense", "function"])
def test_a_backward_uses_the_mask_its_forward_used(backend, case):
    if backend.namespace != "torch":
        pytest.skip("torch autograd: a backward that runs after the caller's code")
    import torch

    make, old, new = CASES[case]
    qkv = _qkv(backend)
    want = _gradients(backend, "reference", make, _arrays(backend, old),
                      [x.double() for x in qkv])
    failures, ran = [], set()
    for route, write in _writers(backend).items():
        for name in _kernels(backend):
            try:
                got = _gradients(backend, name, make, _arrays(backend, old), qkv, write, new)
            except KernelNotUsableError:
                continue
            except RuntimeError as e:  # torch's own check of a saved tensor: clear
                if "modified by an inplace operation" not in str(e):
                    raise
                continue
            ran.add(name)
            for what, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
                if not torch.allclose(g.double(), w, rtol=2e-4, atol=2e-4):
                    failures.append(f"{name}, written by {route}: {what} differs by "
                                    f"{(g.double() - w).abs().max().item():.3g}")
    assert ran
    assert not failures, "\n".join(failures)
