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


def test_info_shows_a_broken_plugin_as_unavailable(monkeypatch, capsys):
    from portattn import _registry

    broken = _registry.KernelEntry("broken", None, "portattn-broken", "1.0",
                                   "unavailable: failed to import x: ImportError: nope")
    monkeypatch.setattr(_registry, "kernels", lambda: [broken])
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
