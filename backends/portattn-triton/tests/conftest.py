"""Run the kernel through Triton's CPU interpreter; the ``backend``/``xp`` harness of
portattn.testing.

Triton's ``@jit`` reads ``TRITON_INTERPRET`` when the kernel module is imported, and the
kernel class declares the ``cpu`` device from it at import, so the variable is set here,
before either module is imported. Run these tests in their own pytest process: with
the interpreter on, ``triton_flash`` also accepts CPU torch tensors there.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_too_late = [m for m in ("portattn_triton._kernel", "portattn_triton._triton_kernel")
             if m in sys.modules]
if _too_late:
    msg = (f"{', '.join(_too_late)} was imported before TRITON_INTERPRET=1 was set; run "
           "the portattn-triton tests in their own pytest process")
    raise RuntimeError(msg)

from portattn.testing.plugin import backend, xp  # noqa: E402

__all__ = ["backend", "xp"]
