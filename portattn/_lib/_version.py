"""The version of this distribution of portattn (``portattn.__version__``)."""

from __future__ import annotations

__all__ = ["VERSION"]

VERSION = "0.1.0"
