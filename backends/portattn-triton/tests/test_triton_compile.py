"""Ahead-of-time compilation for sm_80 and sm_90, without a GPU.

Every kernel (the forward's pointer, tensor-descriptor and decode paths, the backward's
Delta, dK/dV and dQ passes, paged attention's tiles at each height and the merge of
their splits) in the block configurations the launcher can pick, for float16,
bfloat16 and float32, in the variants of ``triton_compile_configs.variants``
(the plain path; the in-kernel masks; with bit tiles; with a bias and its gradient too,
each in the configuration the launcher picks for it), must compile, fit the
generation's shared memory and use no local memory for spills; and the code must be
what the generation is for, read from the PTX and from the SASS (NVIDIA's
disassembler, shipped in Triton's wheel): on sm_90 the tensor-descriptor kernel's
tiles arrive by bulk tensor copies (``cp.async.bulk.tensor``, ``UTMALDG``) and its
2-byte products run on ``wgmma`` (``HGMMA``); on sm_80 products run on ``mma.sync``
(``HMMA``) and nothing Hopper-only appears. The compiler runs in subprocesses (one per
generation, in parallel) because this test process has ``TRITON_INTERPRET=1`` set.
``PORTATTN_TRITON_COMPILE_DTYPES`` (e.g. ``bfloat16``) narrows the dtypes.

Every case, ``PORTATTN_TRITON_COMPILE=all`` (the ``long`` tox env): 817 kernels for
bfloat16 and float32, about 22 minutes on 2 cores. By default (CI) the cases where
registers and shared memory run out first: each variant of each kernel at the widest
head dim it is compiled for, and the plain kernels at the narrowest (the smallest
tiles), 215 of the 817. A case with more features does not stand for one with fewer: of
303 pairs of cases whose configuration is the same and one of which has every feature
of the other, 89 used fewer registers or less shared memory with more features.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from portattn_triton._configs import BLOCK_DIMS

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent))
from triton_compile_configs import ELEMENTWISE, KERNELS, variants  # noqa: E402

SCRIPT = Path(__file__).with_name("triton_compile_configs.py")
ARCHS = (80, 90)
DTYPES = tuple(os.environ.get("PORTATTN_TRITON_COMPILE_DTYPES",
                              "float16,bfloat16,float32").split(","))
#: The backward passes use the same configs for float16 and bfloat16, and compile to
#: the same register use; bfloat16 (the usual training dtype) stands for both.
BACKWARD_DTYPES = tuple(d for d in DTYPES if d != "float16" or "bfloat16" not in DTYPES)
KERNEL_NAMES = (*KERNELS, *ELEMENTWISE)
EVERY = [(arch, kernel, dtype, dim, variant) for arch in ARCHS for kernel in KERNEL_NAMES
         for dtype in (DTYPES if kernel == "forward" else BACKWARD_DTYPES)
         for dim in BLOCK_DIMS for variant in variants(arch, dtype, dim, kernel)]


def heaviest(cases: list[tuple]) -> list[tuple]:
    """Each variant of each kernel at the widest head dim it has, and the plain kernels
    at the narrowest."""
    widest: dict[tuple, int] = {}
    for arch, kernel, dtype, dim, variant in cases:
        key = (arch, kernel, dtype, variant)
        widest[key] = max(widest.get(key, 0), dim)
    return [c for c in cases if c[3] == widest[(*c[:3], c[4])]
            or (c[3] == min(BLOCK_DIMS) and c[4] == "plain")]


CASES = EVERY if os.environ.get("PORTATTN_TRITON_COMPILE") == "all" else heaviest(EVERY)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    folder = tmp_path_factory.mktemp("compile")
    procs = []
    for arch in ARCHS:  # one process per generation, at once
        cases = folder / f"sm_{arch}.json"
        cases.write_text(json.dumps([c for c in CASES if c[0] == arch]))
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPT), str(arch), "--dtypes", ",".join(DTYPES),
             "--backward-dtypes", ",".join(BACKWARD_DTYPES), "--kernels",
             ",".join(KERNEL_NAMES), "--cases", str(cases)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = {}
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, f"compile script failed:\n{err[-4000:]}"
        for line in out.splitlines():
            r = json.loads(line)
            results[r["arch"], r["kernel"], r["dtype"], r["dim"], r["variant"]] = r
    return results


@pytest.mark.parametrize(("arch", "kernel", "dtype", "dim", "variant"), CASES,
                         ids=[f"sm_{a}-{k}-{t}-d{d}-{v}" for a, k, t, d, v in CASES])
def test_compiles_fits_and_does_not_spill(compiled, arch, kernel, dtype, dim, variant):
    r = compiled[arch, kernel, dtype, dim, variant]
    where = f"sm_{arch} {kernel} {dtype} head_dim {dim} {variant} {r['config']}"
    assert "error" not in r, f"{where}: {r['error']}"
    assert r["shared"] <= r["shared_limit"], (
        f"{where}: {r['shared']} bytes of shared memory > {r['shared_limit']}")
    assert r["spilled"] is not None, f"{where}: no ptxas report:\n{r['ptxas']}"
    assert r["spilled"] == 0, f"{where}: {r['spilled']} bytes spilled:\n{r['ptxas']}"
    sass = r["sass"]
    assert "error" not in sass, f"{where}: no SASS: {sass.get('error')}"
    assert sass["total"] > 0, f"{where}: an empty SASS listing"
    assert sass["local"] == 0, f"{where}: local-memory loads/stores in the SASS"
    if kernel in ELEMENTWISE:  # no products
        return
    ptx, block_m = r["ptx"], int(r["config"].split("-")[0][1:])
    if arch == 80:
        assert ptx["wgmma"] == ptx["tma"] == sass["HGMMA"] == sass["UTMALDG"] == 0, where
        assert ptx["mma_sync"] > 0, f"{where}: no mma.sync in the PTX"
        assert sass["HMMA"] > 0, f"{where}: no HMMA in the SASS"
        return
    if kernel == "tma":
        assert ptx["tma"] > 0, f"{where}: no cp.async.bulk.tensor in the PTX"
        assert sass["UTMALDG"] > 0, f"{where}: no UTMALDG (bulk tensor load) in the SASS"
    if kernel in ("tma", "forward", "decode") and dtype != "float32" and block_m >= 64:
        # 64 rows per warpgroup: the tile is tall enough for wgmma
        assert ptx["wgmma"] > 0, f"{where}: no wgmma in the PTX"
        assert sass["HGMMA"] > 0, f"{where}: no HGMMA in the SASS"
    else:
        assert sass["HGMMA"] + sass["HMMA"] > 0, f"{where}: no tensor-core products"
