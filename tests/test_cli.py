"""``python -m portattn info`` and ``demo``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from portattn.__main__ import main


def test_info_lists_kernels_and_capabilities(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("portattn 0.1.0:")
    lines = out.splitlines()
    tiled = next(line for line in lines if line.startswith("tiled ") and "available" in line)
    assert "portattn 0.1.0" in tiled
    assert "10" in tiled.split()
    header = next(line for line in lines if line.startswith("kernel ") and "masks" in line)
    assert header.split()[:6] == ["kernel", "namespaces", "devices", "dtypes", "head_dim",
                                  "masks"]
    reference = [line for line in lines if line.startswith("reference ")]
    assert reference[1].split()[5] == "all"  # every kind of portattn.masks.KINDS
    assert reference[2].split()[1:] == ["yes"] * 13 + ["-"]


def test_info_lists_the_score_changes_each_kernel_declares(monkeypatch, capsys):
    from portattn import _dispatch
    from portattn._kernels import ReferenceKernel

    class SomeTables(ReferenceKernel):
        name = "some_tables"
        score_mod = frozenset({"relative_position", "alibi"})
        score_functions = False

    class NoChanges(ReferenceKernel):
        name = "no_changes"
        score_mod = False
        score_functions = False

    entries = [_dispatch.KernelEntry(k.name, k(), "portattn-test", "1.0", None)
               for k in (ReferenceKernel, SomeTables, NoChanges)]
    monkeypatch.setattr(_dispatch, "kernels", lambda: entries)
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("score changes"))
    assert lines[start + 1].split() == ["kernel", "functions", "score", "changes", "from",
                                        "tables"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[start + 2:start + 5]}
    assert rows == {"reference": ["yes", "all"], "no_changes": ["-", "-"],
                    "some_tables": ["-", "alibi,relative_position"]}


def test_info_shows_a_broken_plugin_as_unavailable(monkeypatch, capsys):
    from portattn import _dispatch

    broken = _dispatch.KernelEntry("broken", None, "portattn-broken", "1.0",
                                   "unavailable: failed to import x: ImportError: nope")
    monkeypatch.setattr(_dispatch, "kernels", lambda: [broken])
    assert main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("broken"))
    assert line.split()[1:4] == ["portattn-broken", "1.0", "-"]
    assert "unavailable: failed to import x: ImportError: nope" in line


def test_demo_agrees_with_the_reference():
    pytest.importorskip("numpy")
    result = subprocess.run([sys.executable, "-m", "portattn", "demo"], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "agreement with the reference: ok" in result.stdout
    assert result.stdout.splitlines()[2].startswith("numpy")


def test_unknown_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--nope"])
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_info_fits_100_columns_and_wide_puts_it_in_one_table(capsys):
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("where each kernel"))
    assert max(len(line) for line in lines[start:]) <= 100
    example = next((line for line in lines[start:] if line.startswith("example_einsum ")), None)
    if example is not None:  # mask kinds by their names in portattn.masks.KINDS
        assert example.split()[-1] == "causal,sliding_window"
    assert main(["info", "--wide"]) == 0
    wide = capsys.readouterr().out.splitlines()
    header = next(line for line in wide if line.startswith("kernel ") and "masks" in line)
    assert header.split()[5:8] == ["masks", "bias", "cap"]


# --- explain ---------------------------------------------------------------------------


def explained(capsys, *args):
    """``(exit code, stdout, stderr)`` of ``python -m portattn explain ARGS``."""
    code = main(["explain", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_prints_what_portattn_explain_prints(backend, capsys):
    import numpy as np

    import portattn
    from portattn import masks

    code, out, _ = explained(capsys, "--shape", "2,4,64,16", "--library", backend.name,
                             "--mask", "causal", "--mask", "key_lengths:40")
    assert code == 0
    q = backend.asarray(np.zeros((2, 4, 64, 16), dtype=np.float32))
    lengths = backend.asarray(np.full(2, 40, dtype=np.int32))
    plan = portattn.explain(q, q, q, mask=masks.causal() & masks.key_lengths(lengths))
    assert out == f"{plan}\n"
    assert f"namespace={backend.namespace}" in out
    assert "    read as (batch=2, heads=4, length=64, dim=16) with layout='bhld'\n" in out


def test_explain_takes_shapes_masks_and_options(capsys):
    code, out, _ = explained(
        capsys, "--shape", "3,4,32,16", "--kv-shape", "3,2,48,16", "--value-dim", "8",
        "--mask", "sliding_window:8|global_tokens:0,5", "--mask", "key_lengths:40",
        "--bias", "--softcap", "20", "--return-lse", "--alibi", "--sinks")
    assert code == 0
    lines = out.splitlines()
    assert lines[2:5] == [
        "    query : shape=(3, 4, 32, 16) dtype=float32 namespace=numpy device=cpu",
        "    key   : shape=(3, 2, 48, 16) dtype=float32 namespace=numpy device=cpu",
        "    value : shape=(3, 2, 48, 8) dtype=float32 namespace=numpy device=cpu"]
    assert lines[5].startswith("    mask=(sliding_window(left=8, right=0) | global_tokens(")
    assert "& key_lengths(" in lines[5]
    assert "bias=shape=" in lines[5]
    assert "softcap=20.0" in lines[5]
    assert "    alibi_slopes: shape=(1, 4)" in lines
    assert "    sinks: shape=(1, 4)" in lines
    assert "    return_lse" in lines
    assert ("    read as (batch=3, heads=4, kv_heads=2, length=32, kv_length=48, dim=16, "
            "value_dim=8) with layout='bhld'") in lines


@pytest.mark.parametrize("spec", ["causal:top_left", "chunks:8", "sink_tokens:2", "prefix",
                                  "query_lengths:20", "documents:3", "dense"])
def test_explain_builds_each_mask_kind(spec, capsys):
    code, out, _ = explained(capsys, "--shape", "2,2,32,8", "--mask", spec)
    assert code == 0
    kind = spec.partition(":")[0]
    assert f"mask={kind}(" in out


def test_explain_reads_the_layout_and_hints_at_swapped_axes(capsys):
    _, out, _ = explained(capsys, "--shape", "2,1024,8,64")  # (B, L, H, D) as bhld
    assert "    read as (batch=2, heads=1024, length=8, dim=64) with layout='bhld'\n" in out
    assert ("    hint: 1024 heads of length 8 look swapped; for (..., length, heads, dim) "
            "arrays pass layout='blhd'\n") in out
    _, out, _ = explained(capsys, "--shape", "2,1024,8,64", "--layout", "blhd")
    assert "    read as (batch=2, heads=8, length=1024, dim=64) with layout='blhd'\n" in out
    assert "hint" not in out
    _, out, _ = explained(capsys, "--shape", "2,8,1024,64", "--layout", "blhd")
    assert "hint: 1024 heads of length 8 look swapped; for (..., heads, length, dim) " \
        "arrays pass layout='bhld'" in out


@pytest.mark.parametrize("shape", [(1, 32, 1, 64), (2, 256, 16, 64), (4, 8, 1024, 64),
                                   (512, 2048, 64)])
def test_no_layout_hint_for_ordinary_shapes(shape):
    # decoding (many heads, one query), 256 heads, the usual case, no batch axis
    import numpy as np

    import portattn

    q = np.zeros(shape, dtype=np.float32)
    text = str(portattn.explain(q, q, q))
    assert "hint" not in text
    assert "read as (" in text


def test_explain_exit_codes_and_errors(capsys):
    code, out, _ = explained(capsys, "--shape", "1,2,8,4", "--kernel", "tiled",
                             "--return-weights")
    assert code == 1  # the forced kernel cannot run the call
    assert out.startswith("kernel: none can run these inputs")
    for args, error in [
        (("--mask", "bogus:3"), "--mask 'bogus:3': unknown or unsupported kind 'bogus'"),
        (("--mask", "sliding_window:x"), "--mask 'sliding_window:x': invalid literal"),
        (("--library", "nope"), "unknown library 'nope'; known: numpy,"),
        (("--library", "numpy", "--device", "cuda"), "numpy makes its arrays on cpu, not cuda"),
        (("--dtype", "bfloat16"), "numpy has no bfloat16 (it has: float16, float32, float64)"),
        (("--grad",), "--grad: only torch tensors say that they need gradients"),
    ]:
        code, out, err = explained(capsys, "--shape", "1,2,8,4", *args)
        assert (code, out) == (2, ""), args
        assert err.startswith(f"portattn explain: error: {error}"), err
    with pytest.raises(SystemExit):
        main(["explain", "--shape", "8,4"])
    assert "expected at least 3 sizes like 2,8,1024,64; got '8,4'" in capsys.readouterr().err


def test_explain_a_training_call_on_torch(capsys):
    pytest.importorskip("torch")
    code, out, _ = explained(capsys, "--shape", "1,2,16,8", "--library", "torch", "--grad",
                             "--dtype", "bfloat16")
    assert code == 0
    assert "dtype=bfloat16 namespace=torch" in out
    assert "    requires_grad\n" in out


def test_help_lists_explain_and_says_how_to_get_bench(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "explain" in out
    assert "bench" in out
    assert "pip install ./bench/portattn-bench" in " ".join(out.split())
