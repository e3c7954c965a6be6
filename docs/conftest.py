"""Run the examples of the docs pages with Sybil.

Every ```python block of a page runs as a script, in order, in one namespace per page;
a block that starts with ``>>>`` is checked as a doctest. Pages whose examples need a
library beyond NumPy are skipped, with the reason, where that library is missing.
"""

from __future__ import annotations

import doctest
import importlib.util
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
    "distributed.md": ("dask", "distributed", "portattn_dask"),
    "recipes/nanogpt.md": ("torch",),
    "recipes/transformers.md": ("torch", "transformers", "portattn_torch"),
    "recipes/flax.md": ("jax", "flax", "portattn_jax"),
    "backends/torch.md": ("torch", "portattn_torch"),
    "backends/jax.md": ("jax", "portattn_jax"),
    "backends/dask.md": ("dask", "portattn_dask"),
}


def _requiring(modules: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def setup(namespace: dict[str, Any]) -> None:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"the examples on this page need {', '.join(missing)}")
        _as_script(namespace)
    return setup


def _as_script(namespace: dict[str, Any]) -> None:
    """A page runs as a script does: ``if __name__ == "__main__":`` blocks run."""
    namespace["__name__"] = "__main__"


_sybils = [Sybil(PARSERS, patterns=["*.md"], excludes=[*NEEDS, "_build/*"],
                 setup=_as_script, name="docs")]
_sybils += [Sybil(PARSERS, patterns=[page], setup=_requiring(mods), name=page)
            for page, mods in NEEDS.items()]

pytest_collect_file = SybilCollection(_sybils).pytest()
