"""``numpy_fast`` runs paged calls on torch's and JAX's CPU arrays, borrowed through
DLPack: the same answers as each library's own paged loop, results of the caller's
library, and a clear refusal where an array cannot be lent."""

from __future__ import annotations

import numpy as np
import pytest

import portattn
from portattn import masks
from portattn.testing.plugin import require_library

pytestmark = pytest.mark.cross  # several libraries: the cross tox env

pytest.importorskip("numba", reason="the compiled paged loop needs Numba (portattn-numpy[jit])")

HQ, HKV, D, PAGE = 4, 2, 16, 8


def _call(rng):
    """A mixed batch on NumPy: a prompt's end, a decode step and an idle sequence."""
    lengths = np.array([21, 9, 0])
    table = np.array([[3, 0, 5], [1, 4, -1], [-1, -1, -1]], np.int32)
    pools = [rng.standard_normal((6, PAGE, HKV, D), dtype=np.float32) for _ in range(2)]
    query = rng.standard_normal((6, HQ, D), dtype=np.float32)
    return {"query": query, "key_pages": pools[0], "value_pages": pools[1],
            "block_table": table, "key_lengths": lengths,
            "query_starts": np.array([0, 5, 6, 6])}


def _paged(call, **options):
    query, keys, values = call["query"], call["key_pages"], call["value_pages"]
    rest = {k: v for k, v in call.items() if k not in ("query", "key_pages", "value_pages")}
    return portattn.paged_attention(query, keys, values, **rest, **options)


@pytest.mark.parametrize("library", ["torch", "jax"])
def test_another_librarys_cpu_arrays_are_lent_to_the_compiled_loop(library):
    rng = np.random.default_rng(0)
    call = _call(rng)
    if library == "torch":
        torch = require_library("torch")
        lent = {k: torch.from_numpy(v) for k, v in call.items()}
        array_type = torch.Tensor
    else:
        jnp = require_library("jax.numpy")
        lent = {k: jnp.asarray(v) for k, v in call.items()}
        array_type = type(jnp.zeros(1))
    options = {"mask": masks.causal(), "softcap": 5.0, "return_lse": True}
    rest = {k: v for k, v in lent.items() if k not in ("query", "key_pages", "value_pages")}
    plan = portattn.explain_paged(lent["query"], lent["key_pages"], lent["value_pages"],
                                  **rest, mask=options["mask"], softcap=5.0)
    assert plan.kernel is not None
    assert plan.kernel.name == "numpy_fast"
    out, lse = _paged(lent, **options)
    assert isinstance(out, array_type)
    assert isinstance(lse, array_type)
    with portattn.disable_kernels("numpy_fast", "jax_flash"):  # the library's own loop
        expected_out, expected_lse = _paged(lent, **options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected_out), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), rtol=1e-5,
                               atol=1e-5)


def test_tensors_that_require_gradients_are_not_lent():
    torch = require_library("torch")
    call = {k: torch.from_numpy(v) for k, v in _call(np.random.default_rng(1)).items()}
    call["query"].requires_grad_(True)
    plan = portattn.explain_paged(call["query"], call["key_pages"], call["value_pages"],
                                  block_table=call["block_table"],
                                  key_lengths=call["key_lengths"],
                                  query_starts=call["query_starts"])
    reasons = dict((entry.name, why) for entry, why in plan.candidates)["numpy_fast"]
    assert any("require gradients" in why for why in reasons)


def test_jax_flash_defers_to_the_compiled_loop_on_the_cpu():
    jnp = require_library("jax.numpy")
    require_library("portattn_jax", backend="jax")
    call = {k: jnp.asarray(v) for k, v in _call(np.random.default_rng(2)).items()}
    plan = portattn.explain_paged(call.pop("query"), call.pop("key_pages"),
                                  call.pop("value_pages"), **call)
    assert plan.kernel.name == "numpy_fast"
    reasons = dict((entry.name, why) for entry, why in plan.candidates)
    assert reasons["jax_flash"] == ("passed over: defers to numpy_fast",)
    assert "passed over: defers to numpy_fast" in str(plan)


def test_a_call_with_traced_lengths_is_not_planned_on_the_host():
    jax = require_library("jax")
    jnp = require_library("jax.numpy")
    call = {k: jnp.asarray(v) for k, v in _call(np.random.default_rng(3)).items()}
    reasons = {}

    @jax.jit
    def explain(lengths):  # the arrays are closed over: readable, the lengths traced
        plan = portattn.explain_paged(call["query"], call["key_pages"], call["value_pages"],
                                      block_table=call["block_table"], key_lengths=lengths,
                                      query_starts=call["query_starts"])
        reasons.update((entry.name, why) for entry, why in plan.candidates)
        return lengths

    explain(call["key_lengths"])
    assert "key_lengths traced (this kernel plans the call on the host)" in reasons["numpy_fast"]
