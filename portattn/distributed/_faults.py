"""What a rank raises when a distributed call cannot finish because of the other ranks,
and the ``timeout`` that bounds every wait of a call."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CollectiveError", "check_timeout", "failure_text", "gave_up"]


class CollectiveError(RuntimeError):
    """A collective of a :mod:`portattn.distributed` call could not complete on this
    rank: another rank failed, was killed, or did not answer within the call's
    ``timeout``.

    The group's collectives are out of step afterwards (some ranks may have sent what
    others never received): destroy the group (``torch.distributed
    .destroy_process_group``) and start a new one rather than using it again.
    """


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` validated: seconds > 0, or None for the group's own."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        msg = f"timeout must be a number of seconds > 0 or None; got timeout={timeout!r}"
        raise ValueError(msg)
    return float(timeout)


def failure_text(error: BaseException) -> str:
    """One line naming an error for the other ranks: ``TypeError: message``."""
    return f"{type(error).__name__}: {error}"


def gave_up(rank: int, size: int, where: str, why: str) -> CollectiveError:
    """The error a rank raises when it stops waiting for the others."""
    msg = (f"rank {rank} of {size} gave up {where}: {why}. The group's collectives are "
           "out of step now: destroy it rather than using it again")
    return CollectiveError(msg)
