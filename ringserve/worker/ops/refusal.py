"""A rank whose arguments are wrong still takes part in the collective, then raises.

The other ranks wait for this rank's frames, so raising at once would leave them waiting until
their deadline. Instead the rank opens the collective under its descriptor refused for the problem
(``Descriptor.refused``: "... invalid: <problem>") and sends one empty frame round the ring
(programs.confirm) on slots of its own: ranks whose arguments are right see a descriptor that
differs from theirs, and every rank fails with MismatchError (which names the problem) within
``abort_grace_s``; ranks that are all wrong alike finish the lap.

The same lap carries a hierarchical allreduce's failed stage on to its later stages
(hierarchy.py), and a joined rank's refusal of a collective it cannot stand in for (join.py).
"""

from __future__ import annotations

from typing import NoReturn

from ringserve.errors import InvalidArgumentError, MismatchError
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import executor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Values

__all__ = ["REFUSE_SLOT", "lap", "refuse"]

REFUSE_SLOT = 1 << 29  # the lap of a refused collective: apart from the confirmation lap's (programs.CONFIRM_SLOT)


async def lap(session: Session, name: str | None, descriptor: Descriptor, timeout_s: float, *,
              key: str | None = None) -> str:
    """Opens the collective under ``descriptor`` (a refused one) and runs one empty lap of the
    ring; returns its key. ``key``: that very key (a joined rank's, see join.py)."""
    program = programs.confirm(session.ring, REFUSE_SLOT)
    return await executor.run(session, name, descriptor, timeout_s, program, Values(), key=key)


async def refuse(session: Session, name: str | None, descriptor: Descriptor, problem: str, timeout_s: float) -> NoReturn:
    """Takes part in the collective of ``descriptor`` refused for ``problem``, then raises.

    Raises:
        InvalidArgumentError: always, naming ``problem`` (a ValueError, as Horovod's are).
    """
    try:
        await lap(session, name, descriptor.refused(problem), timeout_s)
    except MismatchError as exc:
        raise InvalidArgumentError(f"{problem[0].upper()}{problem[1:]}.") from exc
    raise InvalidArgumentError(f"{problem[0].upper()}{problem[1:]}.")
