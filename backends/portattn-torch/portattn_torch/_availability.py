"""Whether a usable torch is installed, answered without importing it.

Dispatch asks every kernel for its availability, NumPy calls included, and those must
not pay for (or be changed by) importing torch.
"""

from __future__ import annotations

import importlib.util
import re
import sys

#: ``enable_gqa`` appeared in ``scaled_dot_product_attention`` in torch 2.5.
MIN_TORCH = (2, 5)


def torch_unavailable() -> str | None:
    """None when torch >= 2.5 can be imported, else why not."""
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    version = _installed_version()
    if version is not None and version < MIN_TORCH:
        text = ".".join(map(str, version))
        return f"torch {text} is too old (needs >= {MIN_TORCH[0]}.{MIN_TORCH[1]})"
    return None


def aten_ops_missing(*names: str) -> str | None:
    """None when torch has every ``aten`` op named, else the first it lacks (torch is
    imported: ask after :func:`torch_unavailable`)."""
    import torch

    for name in names:
        if not hasattr(torch.ops.aten, name):
            return f"torch has no aten.{name}"
    return None


def _installed_version() -> tuple[int, int] | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        text = getattr(torch, "__version__", "")
    else:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("torch")
        except PackageNotFoundError:  # importable without metadata: a source build
            return None
    match = re.match(r"(\d+)\.(\d+)", str(text))
    return (int(match[1]), int(match[2])) if match else None
