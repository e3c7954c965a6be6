"""The loops compiled with Numba (``portattn-numpy[jit]``), where they load."""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType

__all__ = ["load"]


@functools.cache
def load(name: str) -> ModuleType | None:
    """This package's module ``name`` of compiled loops; None without Numba, and with a
    warning where Numba is installed but fails (one built for another NumPy, a cache it
    cannot write)."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except Exception as e:  # Numba is optional: any failure leaves NumPy's own ufuncs
        if not (isinstance(e, ModuleNotFoundError) and e.name == "numba"):
            warnings.warn(f"numpy_fast: the compiled loops of {name} are unavailable "
                          f"({type(e).__name__}: {e}); NumPy's ufuncs are used",
                          RuntimeWarning, stacklevel=2)
        return None
