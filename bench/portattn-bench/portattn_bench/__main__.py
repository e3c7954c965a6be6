"""``python -m portattn_bench``: the same as the ``portattn-bench`` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
