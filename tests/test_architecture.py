"""The import contracts (``lint-imports`` in the lint env) cover the whole core."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["name"]: c for c in config["contracts"]}


def test_every_private_core_module_is_closed_to_plugins():
    private = {f"portattn.{p.stem}" for p in (ROOT / "portattn").glob("_*.py")
               if not p.stem.startswith("__")}
    private |= {f"portattn.masks.{p.stem}" for p in (ROOT / "portattn" / "masks").glob("_*.py")
                if not p.stem.startswith("__")}
    contract = next(c for name, c in _contracts().items() if name.startswith("Plugins"))
    assert private == set(contract["forbidden_modules"])


def test_every_plugin_is_analysed():
    plugins = {p.name.replace("-", "_") for p in (ROOT / "backends").iterdir()
               if (p / "pyproject.toml").exists()}
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert plugins <= set(config["root_packages"])
    contract = next(c for name, c in _contracts().items() if name.startswith("Plugins"))
    assert plugins <= set(contract["source_modules"])
