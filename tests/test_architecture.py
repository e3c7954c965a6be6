"""The import contracts (``lint-imports`` in the lint env) cover the whole core."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["name"]: c for c in config["contracts"]}


def _private(package: Path, dotted: str) -> set[str]:
    """The private modules and packages right inside ``package``."""
    return {f"{dotted}.{p.stem}" for p in package.glob("_*")
            if not p.stem.startswith("__") and (p.suffix == ".py" or p.is_dir())}


def test_every_private_core_module_is_closed_to_plugins():
    private = _private(ROOT / "portattn", "portattn")
    private |= _private(ROOT / "portattn" / "masks", "portattn.masks")
    contract = next(c for name, c in _contracts().items() if name.startswith("Plugins"))
    assert private == set(contract["forbidden_modules"])


def test_the_core_top_level_holds_public_modules_and_rooms_only():
    # each private module lives in a room (a package that says what it owns)
    loose = [p.name for p in (ROOT / "portattn").glob("_*.py") if not p.stem.startswith("__")]
    assert loose == []
    rooms = [p for p in (ROOT / "portattn").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()]
    contract = next(c for name, c in _contracts().items() if name.startswith("The core in rooms"))
    layered = {m.strip() for layer in contract["layers"] for m in layer.split("|")}
    assert {p.name for p in rooms} <= layered
    for room in rooms:  # an opening docstring: what it owns, what it may import
        assert (room / "__init__.py").read_text().startswith('"""'), room


def test_every_plugin_is_analysed():
    plugins = {p.name.replace("-", "_") for p in (ROOT / "backends").iterdir()
               if (p / "pyproject.toml").exists()}
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert plugins <= set(config["root_packages"])
    contract = next(c for name, c in _contracts().items() if name.startswith("Plugins"))
    assert plugins <= set(contract["source_modules"])


def test_the_house_plan_in_the_docs_names_every_layer_in_order():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line.split("|")[1].strip() for line in page.splitlines()
            if line.startswith("| `")]
    table = [tuple(sorted(n.strip(" `") for n in row.split(","))) for row in rows]
    contract = next(c for name, c in _contracts().items() if name.startswith("The core in rooms"))
    layers = [tuple(sorted(m.strip() for m in layer.split("|"))) for layer in contract["layers"]]
    assert table == layers
