"""The portattn-torch suite's fixtures: the ``backend``/``xp`` harness of portattn.testing."""

from __future__ import annotations

from portattn.testing.plugin import backend, xp

__all__ = ["backend", "xp"]
