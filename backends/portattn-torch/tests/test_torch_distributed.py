"""portattn.distributed over torch.distributed: 2 and 4 gloo processes on loopback,
forward and gradients (query, key, value, and through the lse) against one float64
call of the whole sequence, for each mask kind, GQA, softcap, Lq != Lk, every
strategy and both layouts.

Each world size is one spawn that runs every case (starting processes costs seconds);
the tests then compare what rank 0 gathered.
"""

from __future__ import annotations

import os
import runpy
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import portattn  # noqa: E402
from portattn import distributed, masks  # noqa: E402
from portattn.testing import tolerance  # noqa: E402

# name: (lq, lk, hq, hkv, mask, softcap, strategy, layout, dtype)
CASES = {
    "causal-ring-zigzag": (23, 23, 2, 2, "causal", None, "ring", "zigzag", "float32"),
    "causal-gather-contiguous": (23, 23, 2, 2, "causal", None, "all_gather", "contiguous",
                                 "float32"),
    "window-ring-zigzag": (23, 23, 2, 2, "window", None, "ring", "zigzag", "float32"),
    "window-gather-zigzag": (23, 23, 2, 2, "window", None, "all_gather", "zigzag", "float32"),
    "key_lengths-ring-contiguous": (23, 23, 2, 2, "key_lengths", None, "ring", "contiguous",
                                    "float32"),
    "documents-ring-zigzag": (23, 23, 2, 2, "documents", None, "ring", "zigzag", "float32"),
    "documents-gather-contiguous": (23, 23, 2, 2, "documents", None, "all_gather",
                                    "contiguous", "float32"),
    "gqa-gather-contiguous": (23, 23, 4, 1, None, None, "all_gather", "contiguous",
                              "float32"),
    "gqa_softcap-ring-zigzag": (23, 23, 4, 2, "causal", 5.0, "ring", "zigzag", "float32"),
    "cross-ring-contiguous": (9, 23, 2, 2, "causal", None, "ring", "contiguous", "float32"),
    "cross_window-gather-zigzag": (9, 23, 2, 1, "window", None, "all_gather", "zigzag",
                                   "float32"),
    "documents-ulysses-zigzag": (23, 23, 4, 4, "documents", None, "ulysses", "zigzag",
                                 "float32"),
    "cross_gqa-ulysses-contiguous": (9, 23, 8, 4, "causal", 5.0, "ulysses", "contiguous",
                                     "float32"),
    "causal64-ring-zigzag": (23, 23, 2, 2, "causal", None, "ring", "zigzag", "float64"),
    "gqa-auto-zigzag": (23, 23, 4, 2, "causal", None, "auto", "zigzag", "float32"),
    "causal_bf16-ring-zigzag": (23, 23, 2, 2, "causal", None, "ring", "zigzag", "bfloat16"),
}
SIZES = (2, 4)
EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "context_parallel_torch.py"
STEPS, LENGTH = 50, 61
COMPILED = ("ring", "all_gather", "ulysses")
SUBGROUP = ("causal-ring-zigzag", "documents-ulysses-zigzag")


def _mask(kind, lq, lk):
    if kind is None:
        return None
    if kind == "causal":
        return masks.causal()
    if kind == "window":
        return masks.sliding_window(5, 2)
    if kind == "key_lengths":
        return masks.causal() & masks.key_lengths(torch.tensor([17, lk]))
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([6, 1, 9, lk - 16]))
    return masks.causal() & masks.documents(ids)


def _inputs(case, dtype=torch.float64):
    """q, k, v and the gradients of out and lse, the same in every process."""
    lq, lk, hq, hkv = CASES[case][:4]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))

    def normal(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    return (normal(2, hq, lq, 8), normal(2, hkv, lk, 8), normal(2, hkv, lk, 8),
            normal(2, hq, lq, 8), normal(2, hq, lq))


def _loss(out, lse, gout, glse):
    finite = torch.isfinite(lse)
    return (out.double() * gout).sum() + (torch.where(finite, lse, 0).double() * glse).sum()


def _one_case(case, group):
    lq, lk, _, _, kind, softcap, strategy, layout, dtype = CASES[case]
    q, k, v, gout, glse = _inputs(case)
    mask = _mask(kind, lq, lk)
    shards = [distributed.shard(x.to(getattr(torch, dtype)), group, layout=layout)
              .requires_grad_() for x in (q, k, v)]
    out, lse = distributed.attention(*shards, group=group, mask=mask, strategy=strategy,
                                     layout=layout, query_length=lq, key_length=lk,
                                     softcap=softcap, return_lse=True)
    gout_s = distributed.shard(gout, group, layout=layout)
    glse_s = distributed.shard(glse[..., None], group, layout=layout)[..., 0]
    _loss(out, lse, gout_s, glse_s).backward()

    def whole(x, n):
        return distributed.unshard(x.detach(), group, length=n, layout=layout)

    return {"out": whole(out, lq), "lse": whole(lse[..., None], lq)[..., 0],
            "dq": whole(shards[0].grad, lq), "dk": whole(shards[1].grad, lk),
            "dv": whole(shards[2].grad, lk), "dtypes": (str(out.dtype), str(lse.dtype))}


class _Block(torch.nn.Module):
    """A projection, distributed causal attention over 2 heads of 4, a projection."""

    def __init__(self, strategy, length):
        super().__init__()
        self.strategy, self.length = strategy, length
        self.qkv, self.proj = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        out = distributed.attention(q, k, v, group=None, mask=masks.causal(),
                                    strategy=self.strategy, layout="zigzag",
                                    query_length=self.length, key_length=self.length)
        return self.proj(out.transpose(1, 2).flatten(-2)).tanh()


def _compiled_and_eager(strategy, length=11, steps=2):
    """Losses, gradients and the output of the last step of a few SGD steps, eager,
    under torch.compile and, for "ulysses", under torch.compile(fullgraph=True) (the
    same initial weights and shards on every rank)."""
    torch.manual_seed(0)
    eager = _Block(strategy, length)
    x = distributed.shard(torch.randn(1, length, 8, generator=torch.Generator().manual_seed(1)),
                          None, axis=-2, layout="zigzag")
    runs = {}
    for name in ("eager", "compiled", "fullgraph")[:3 if strategy == "ulysses" else 2]:
        model = _Block(strategy, length)
        model.load_state_dict(eager.state_dict())
        torch.compiler.reset()  # each compiles afresh (Dynamo's cache is per function)
        call = (model if name == "eager" else
                torch.compile(model, fullgraph=name == "fullgraph"))
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(steps):
            sgd.zero_grad()
            out = call(x)
            loss = out.square().sum()
            loss.backward()
            sgd.step()
            losses.append(loss.detach())
        runs[name] = {"losses": torch.stack(losses), "out": out.detach(),
                      **{n: p.grad.clone() for n, p in model.named_parameters()}}
    return runs


def _graph_break():
    """What Dynamo makes of the call: its graphs and breaks, and fullgraph's error."""
    torch.compiler.reset()  # else graphs compiled before are reused
    block = _Block("all_gather", 11)
    x = distributed.shard(torch.zeros(1, 11, 8), None, axis=-2, layout="zigzag")
    explained = torch._dynamo.explain(block)(x)
    found = {"graphs": explained.graph_count,
             "breaks": [str(r.reason) for r in explained.break_reasons], "fullgraph": None}
    torch.compiler.reset()
    try:
        torch.compile(block, fullgraph=True)(x)
    except Exception as e:  # Dynamo's error names the function and the reason
        found["fullgraph"] = f"{type(e).__name__}: {e}"
    return found


def _worker(rank, size, port, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        results = {case: _one_case(case, None) for case in CASES}
        # a group that is not the default one: the ranks in reverse order
        sub = dist.new_group(list(range(size))[::-1])
        results["subgroup"] = {case: _one_case(case, sub) for case in SUBGROUP}
        train = runpy.run_path(os.fspath(EXAMPLE))["train"]
        results["training"] = train(STEPS, LENGTH, dist.group.WORLD, "zigzag", "ring")
        if size == 2:  # compiling costs seconds: one world size
            results["compiled"] = {s: _compiled_and_eager(s) for s in COMPILED}
            results["graph_break"] = _graph_break()
        if rank == 0:
            torch.save(results, path)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=SIZES, ids=lambda n: f"{n}ranks")
def gathered(request, tmp_path_factory):
    size = request.param
    path = os.fspath(tmp_path_factory.mktemp("dist") / "results.pt")
    torch.multiprocessing.spawn(_worker, args=(size, _free_port(), path), nprocs=size,
                                join=True)
    return size, torch.load(path)


def _expected(case):
    lq, lk, _, _, kind, softcap, *_ = CASES[case]
    q, k, v, gout, glse = _inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = portattn.attention(*leaves, mask=_mask(kind, lq, lk), softcap=softcap,
                                  return_lse=True, kernel="reference")
    _loss(out, lse, gout, glse).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": leaves[0].grad,
            "dk": leaves[1].grad, "dv": leaves[2].grad}


def _single_device_error(case, name):
    """How far one float32 (or half) call of the whole sequence is from float64."""
    lq, lk, _, _, kind, softcap, _, _, dtype = CASES[case]
    q, k, v, gout, glse = _inputs(case)
    leaves = [x.to(getattr(torch, dtype)).requires_grad_() for x in (q, k, v)]
    out, lse = portattn.attention(*leaves, mask=_mask(kind, lq, lk), softcap=softcap,
                                  return_lse=True)
    _loss(out, lse, gout, glse).backward()
    got = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
           "dv": leaves[2].grad}[name]
    return _error(got.detach(), _expected(case)[name])


def _error(got, want):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    return float((got.double() - want)[finite].abs().max()) if finite.any() else 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_matches_one_float64_call(gathered, case):
    size, results = gathered
    got, want = results[case], _expected(case)
    dtype = CASES[case][-1]
    assert got["dtypes"] == (f"torch.{dtype}",
                             "torch.float32" if dtype == "bfloat16" else f"torch.{dtype}")
    rtol, atol = tolerance(dtype)
    for name in ("out", "lse", "dq", "dk", "dv"):
        scale = 1 + float(want[name][torch.isfinite(want[name])].abs().max())
        # gradients sum many terms: the tolerance grows with their magnitude
        assert _error(got[name], want[name]) <= atol + rtol * scale, (case, size, name)


@pytest.mark.parametrize("case", ["causal-ring-zigzag", "documents-ring-zigzag",
                                  "gqa_softcap-ring-zigzag", "causal_bf16-ring-zigzag"])
def test_errors_do_not_grow_with_the_world_size(gathered, case):
    size, results = gathered
    want = _expected(case)
    for name in ("out", "lse", "dq", "dk", "dv"):
        single = _single_device_error(case, name)
        mine = _error(results[case][name], want[name])
        assert mine <= 2 * single + tolerance(CASES[case][-1])[1] / 10, (name, size, mine,
                                                                         single)


@pytest.mark.parametrize("case", SUBGROUP)
def test_a_subgroup_with_other_ranks(gathered, case):
    _, results = gathered
    for name in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(results["subgroup"][case][name], results[case][name],
                                   rtol=0, atol=0)


def test_training_follows_the_one_process_loss_curve(gathered):
    """The documented example: a 2-layer causal transformer, 50 steps of Adam with
    each sequence (61 tokens: padded) split over the ranks."""
    size, results = gathered
    torch.set_num_threads(1)
    whole = runpy.run_path(os.fspath(EXAMPLE))["train"](STEPS, LENGTH)
    split = results["training"]
    assert len(split) == len(whole) == STEPS
    assert whole[-1] < whole[0] - 0.1  # it learns
    assert max(abs(a - b) for a, b in zip(split, whole, strict=True)) < 1e-4, size


@pytest.mark.parametrize("strategy", COMPILED)
def test_torch_compile_trains_as_eager(gathered, strategy):
    """torch.compile(model) around the call (a graph break there, the projections
    compiled): the same losses, gradients and outputs as eager, to float32 rounding
    (the compiled projections may sum in another order)."""
    size, results = gathered
    if size != 2:
        pytest.skip("compiled on 2 ranks only")
    runs = results["compiled"][strategy]
    # "ulysses" is traced, with fullgraph=True too (its all-to-alls are functional)
    assert runs.keys() == {"eager", "compiled"} | ({"fullgraph"} if strategy == "ulysses"
                                                   else set())
    assert runs["eager"]["losses"][1] < runs["eager"]["losses"][0]  # it trains
    for run in runs.keys() - {"eager"}:
        assert runs[run].keys() == runs["eager"].keys()
        for name, want in runs["eager"].items():
            torch.testing.assert_close(runs[run][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=run, n=name: f"{strategy} {r} {n}: {m}")


def test_torch_compile_breaks_the_graph_at_the_call_only(gathered):
    """The projections before and after are graphs; the one break is the call, and
    fullgraph=True refuses it with the reason."""
    size, results = gathered
    if size != 2:
        pytest.skip("compiled on 2 ranks only")
    found, reason = results["graph_break"], "runs eagerly under torch.compile (a graph break)"
    assert found["graphs"] >= 2, found  # before and after the call (and the call's own)
    assert len(found["breaks"]) == 1, found
    assert reason in found["breaks"][0]
    assert found["fullgraph"] is not None
    assert reason in found["fullgraph"]


def test_errors_without_a_process_group():
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.attention(q, q, q, group=None)
    with pytest.raises(TypeError, match="group="):
        distributed.attention(q, q, q, group="world")
