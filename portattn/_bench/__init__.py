"""``portattn bench``: time every installed kernel on this machine.

Imported only by the command line (``python -m portattn bench``) and by ``bench/``;
``import portattn`` never imports it. matplotlib and tqdm (the ``bench`` extra) are
imported when needed, with a clear message when missing.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
