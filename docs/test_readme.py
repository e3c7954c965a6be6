"""The READMEs' Python examples, run as the docs pages' are (see ``conftest.py``), and
their relative links, checked.

The READMEs sit above ``docs/``, out of reach of this folder's collection hook, so their
examples are parsed here and run one test each, in order, in one shared namespace per
README. A plugin README's examples are skipped, with the reason, where the libraries of
that plugin are not installed.
"""

from __future__ import annotations

import doctest
import importlib.util
import re
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser

PARSERS = [PythonCodeBlockParser(
    doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)]
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PLUGIN_READMES = sorted(ROOT.glob("backends/*/README.md"))

# plugin folder -> the modules its README's examples may import
PLUGIN_NEEDS: dict[str, tuple[str, ...]] = {
    "portattn-numpy": ("numpy", "portattn_numpy"),
    "portattn-torch": ("torch", "portattn_torch"),
    "portattn-jax": ("jax", "portattn_jax"),
    "portattn-dask": ("dask", "portattn_dask"),
    "portattn-triton": ("torch", "triton", "portattn_triton"),
}

_document = Sybil(PARSERS).parse(README)
_examples = list(_document.examples())
_plugin_examples = [(path, example) for path in PLUGIN_READMES
                    for example in Sybil(PARSERS).parse(path).examples()]


def test_readme_has_examples() -> None:
    assert _examples, f"no Python example found in {README}"


@pytest.mark.parametrize("example", _examples, ids=lambda e: f"line{e.line}")
def test_readme_example(example) -> None:
    example.evaluate()


def _plugin_id(item: tuple[Path, object] | None) -> str:
    if item is None:
        return "none"
    path, example = item
    return f"{path.parent.name}-line{example.line}"


@pytest.mark.parametrize("item", _plugin_examples or [pytest.param(
    None, marks=pytest.mark.skip(reason="no plugin README holds a Python example"))],
    ids=_plugin_id)
def test_plugin_readme_example(item) -> None:
    path, example = item
    needs = PLUGIN_NEEDS.get(path.parent.name, ())
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the examples of {path.parent.name}'s README need {', '.join(missing)}")
    example.evaluate()


# [text](target) and ![alt](target), with an optional "title"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository: no scheme
    (``https:``, ``mailto:``), no bare ``#anchor``; code blocks are left out."""
    text = _FENCE.sub("", text)
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target)
    return targets


def test_relative_links_finds_what_it_should() -> None:
    text = ("[a](docs/a.md) [b](https://x.org/) ![c](img/c.png \"t\") [d](#top) "
            "[e](../e.md#part)\n```\n[f](not/a/link.md)\n```\n")
    assert relative_links(text) == ["docs/a.md", "img/c.png", "../e.md#part"]


@pytest.mark.parametrize("readme", [README, *PLUGIN_READMES],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_links_point_at_files(readme: Path) -> None:
    targets = relative_links(readme.read_text(encoding="utf-8"))
    broken = [t for t in targets
              if not (readme.parent / t.split("#", 1)[0]).exists()]
    assert not broken, f"{readme.relative_to(ROOT)} links to missing files: {broken}"
