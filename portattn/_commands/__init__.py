"""The command line's commands (``python -m portattn``): ``explain`` a call from its
description, the ``demo`` on every installed library, and ``tune``, which times the
kernels here and writes what dispatch then prefers.

The top of the house: it may import everything else.
"""

from __future__ import annotations

from ._demo import run_demo
from ._explain import add_arguments as add_explain_arguments
from ._explain import run as run_explain
from ._tune_run import main as tune_main

__all__ = ["add_explain_arguments", "run_demo", "run_explain", "tune_main"]
