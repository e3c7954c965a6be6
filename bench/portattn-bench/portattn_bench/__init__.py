"""portattn-bench: time every installed portattn kernel on this machine.

A distribution of its own (``pip install ./bench/portattn-bench``), built on portattn's
public API only; the command is ``portattn-bench`` (or ``python -m portattn bench``,
which hands over to it). It puts its inputs on the test suite's backends
(:mod:`portattn.testing`). matplotlib and tqdm are imported when needed.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
