"""How the ranks of a call fail together: a rank refused on its own inputs still joins
the agreement's collective, carrying its error, and a rank that raises during the
schedule tells the others where its communicator can (:meth:`LocalGroup.abort
<portattn.distributed.LocalGroup.abort>`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .._lib import torch_compiling
from ._agree import encode
from ._faults import CollectiveError, check_timeout, failure_text

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["aborting", "tell_the_others", "timed"]


def timed(group: Any, seconds: float | None) -> Any:
    """A communicator passed as ``group``, waiting at most ``seconds``."""
    if seconds is None:
        return group
    with_timeout = getattr(group, "with_timeout", None)
    if with_timeout is None:
        msg = (f"timeout={seconds:g} needs a group that takes one (a LocalGroup, or a "
               f"group of an engine); got group={group!r}")
        raise TypeError(msg)
    return with_timeout(seconds)


def tell_the_others(error: Exception, engine: Any, group: Any, like: Any,
                    timeout: Any) -> None:
    """Send this rank's failure through the agreement's collective, so the other ranks
    raise now rather than wait for it in the schedule; never raises itself (the
    caller raises ``error``)."""
    if torch_compiling():  # a traced call cannot run a collective of its own here
        return
    try:
        seconds = check_timeout(timeout)
    except ValueError:
        seconds = None
    payload = encode(None, failure_text(error))
    # this rank raises its own error whatever the others answer, or if they are gone
    with contextlib.suppress(Exception):
        if engine is None:
            timed(group, seconds).all_gather(payload)
        else:
            engine.exchange(payload, group, like, seconds)


def aborting(comm: Any, run: Callable[[], Any]) -> Any:
    """``run()``; when it raises on this rank (not because of another rank), tell the
    others through ``comm.abort`` where the communicator has one."""
    try:
        return run()
    except CollectiveError:
        raise
    except Exception as e:
        abort = getattr(comm, "abort", None)
        if abort is not None:
            abort(failure_text(e))
        raise
