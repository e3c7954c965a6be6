"""The README's Python examples, run as the docs pages' are (see ``conftest.py``).

The README sits above ``docs/``, out of reach of this folder's collection hook, so its
examples are parsed here and run one test each, in order, in one shared namespace.
"""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser

PARSERS = [PythonCodeBlockParser(
    doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)]
README = Path(__file__).resolve().parent.parent / "README.md"
_document = Sybil(PARSERS).parse(README)
_examples = list(_document.examples())


def test_readme_has_examples() -> None:
    assert _examples, f"no Python example found in {README}"


@pytest.mark.parametrize("example", _examples, ids=lambda e: f"line{e.line}")
def test_readme_example(example) -> None:
    example.evaluate()
