"""Sphinx configuration for portattn's documentation."""

from __future__ import annotations

import portattn

project = "portattn"
author = "portattn contributors"
copyright = "portattn contributors"
release = portattn.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "matplotlib.sphinxext.plot_directive",
]

# Pictures of masks (masks.show) drawn at build time; their code is shown above them.
plot_include_source = True
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 80)]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "conftest.py", "test_*.py"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"portattn {release}"

# The API pages: docstrings are Google/NumPy style (napoleon); type hints stay in the
# signatures, written as in the source.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = True

# Offline builds: no intersphinx inventories are fetched.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

nitpicky = True
nitpick_ignore: list[tuple[str, str]] = []
# Names of other libraries and of typing constructs that autodoc writes into signatures
# and that no inventory here can resolve.
nitpick_ignore_regex = [
    (r"py:class", r"(contextlib|pytest)\..*"),
    (r"py:.*", r"(numpy|np|torch|jax|cupy|dask|da|xp|types|collections\.abc)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|ModuleType|Self)"),
    (r"py:class", r"portattn\.masks\._.*"),  # private classes in public signatures
]



# Napoleon reads the first line of a property or attribute "text: more text" as "type: description".
# Those docstrings are prose here, so they bypass napoleon.
def _keep_property_docstring(app, what, name, obj, options, lines):
    if what in ("property", "attribute"):
        app.env.temp_data.setdefault("portattn_property_lines", {})[name] = list(lines)


def _restore_property_docstring(app, what, name, obj, options, lines):
    kept = app.env.temp_data.get("portattn_property_lines", {}).pop(name, None)
    if what in ("property", "attribute") and kept is not None:
        lines[:] = kept


def setup(app):
    app.connect("autodoc-process-docstring", _keep_property_docstring, priority=100)
    app.connect("autodoc-process-docstring", _restore_property_docstring, priority=900)
