"""Run the examples of the docs pages with Sybil.

Every ```python block of a page runs as a script, in order, in one namespace per page;
a block that starts with ``>>>`` is checked as a doctest. Pages whose examples need a
library beyond NumPy are skipped, with the reason, where that library is missing,
except the pages named in ``PORTATTN_DOCS_PAGES`` (paths from the repository root,
separated by spaces): the tox env that has their libraries runs them, and there a
missing library fails the page.
"""

from __future__ import annotations

import doctest
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import pytest
from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser
from sybil.sybil import SybilCollection

PARSERS = [PythonCodeBlockParser(
    doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)]

# page -> the modules its examples import
NEEDS: dict[str, tuple[str, ...]] = {
    "training.md": ("torch",),
    "scores.md": ("torch",),
    "distributed.md": ("dask", "distributed", "portattn_dask"),
    "recipes/nanogpt.md": ("torch",),
    "recipes/transformers.md": ("torch", "transformers", "portattn_torch"),
    "recipes/serving.md": ("torch", "transformers", "portattn_torch"),
    "recipes/t5.md": ("torch", "transformers"),
    "recipes/flax.md": ("jax", "flax", "portattn_jax"),
    "backends/torch.md": ("torch", "portattn_torch"),
    "backends/jax.md": ("jax", "portattn_jax"),
    "backends/dask.md": ("dask", "portattn_dask"),
}


REQUIRED = {page.removeprefix("docs/")
            for page in os.environ.get("PORTATTN_DOCS_PAGES", "").split()}
"""Pages whose examples must run here: a missing library fails them."""


def _requiring(page: str, modules: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def setup(namespace: dict[str, Any]) -> None:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            why = f"the examples on this page need {', '.join(missing)}"
            if page in REQUIRED:
                pytest.fail(f"{why}, and PORTATTN_DOCS_PAGES names docs/{page}")
            pytest.skip(why)
        _as_script(namespace)
    return setup


def _as_script(namespace: dict[str, Any]) -> None:
    """A page runs as a script does: ``if __name__ == "__main__":`` blocks run."""
    namespace["__name__"] = "__main__"


_sybils = [Sybil(PARSERS, patterns=["*.md"], excludes=[*NEEDS, "_build/*"],
                 setup=_as_script, name="docs")]
_sybils += [Sybil(PARSERS, patterns=[page], setup=_requiring(page, mods), name=page)
            for page, mods in NEEDS.items()]

pytest_collect_file = SybilCollection(_sybils).pytest()
