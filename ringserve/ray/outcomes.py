"""What the executor decides from its actors' outcomes: pure, with no Ray and no clock.

The executor (programs/executor.py) waits on its actors' calls and turns each ending into an ``Outcome``;
these functions decide what follows, so that the rules are tested in microseconds:

- **Fixed worlds** (``num_workers``): every rank must return. The first failure ends the run, but
  its report waits a moment (``SECONDARY_FAILURE_DELAY_S``) for the others: a rank that raised for
  its own reason makes the others fail with recoverable errors (their ring changed), and the
  report must name the rank that failed first for a reason of its own (``primary``).
- **Elastic worlds** (``min_workers``/``max_workers``): an actor that dies (killed, its node lost,
  out of memory) costs the others the steps since their last commit; a replacement is placed in
  its bundle after a cooldown, within ``reset_limit`` replacements (``Elastic.on_death``). An
  error raised by the function itself ends the run: it is the program's, and a replacement would
  raise it again. The run is over once the first rank returns and either every member of that
  rank's final view has returned too, or the world is empty; actors still waiting to be admitted
  then are let go (``Elastic.complete``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SECONDARY_FAILURE_DELAY_S = 2.0


@dataclass(frozen=True)
class Outcome:
    """How one actor's call ended.

    Attributes:
        slot: the actor's place (its bundle and rank hint).
        ok: the function returned ``value``.
        rank, size: the rank and world size the function ended in (None: it shut ringserve down
            itself, or never joined).
        died: the actor died (a RayActorError); else the function raised ``error``.
        recoverable: the error is a ringserve RecoverableError (a consequence of a peer's failure).
    """

    slot: int
    ok: bool
    value: Any = None
    rank: int | None = None
    size: int | None = None
    died: bool = False
    error: str = ""
    recoverable: bool = False


def primary(failures: list[Outcome]) -> Outcome:
    """The failure to report, among those in arrival order: the first that is not a consequence
    of another's (not recoverable), else the first.

    Raises:
        ValueError: no failures.
    """
    if not failures:
        raise ValueError("There is no failure to report.")
    return next((f for f in failures if not f.recoverable), failures[0])


def in_rank_order(done: list[Outcome]) -> list[Any]:
    """The values of the calls that returned: by the rank they ended in, those without one last,
    by slot."""
    ranked = sorted(done, key=lambda o: (o.rank is None, o.rank if o.rank is not None else 0, o.slot))
    return [o.value for o in ranked]


class Elastic:
    """The elastic run's bookkeeping (see the module docstring).

    Example:
        ```python
        plan = Elastic(reset_limit=3)
        if plan.on_death(outcome):   # True: place a replacement in outcome.slot
            ...
        ```
    """

    def __init__(self, reset_limit: int | None) -> None:
        self.reset_limit = reset_limit
        self.replacements = 0
        self.done: list[Outcome] = []
        self.deaths: list[Outcome] = []

    @property
    def finishing(self) -> bool:
        """Some rank has returned: the job's training is over, no replacement is placed."""
        return bool(self.done)

    def on_death(self, outcome: Outcome) -> bool:
        """Records a dead actor; returns whether a replacement is to be placed in its slot."""
        self.deaths.append(outcome)
        if self.finishing or (self.reset_limit is not None and self.replacements >= self.reset_limit):
            return False
        self.replacements += 1
        return True

    def on_return(self, outcome: Outcome) -> None:
        self.done.append(outcome)

    def complete(self, world_empty: bool) -> bool:
        """Whether the run is over though some actors are still running: every member of the
        final view (as the returned ranks name it) has returned, or the world is empty."""
        if not self.done:
            return False
        if world_empty:
            return True
        sizes = [o.size for o in self.done if o.size is not None]
        if not sizes:
            return False
        final = sizes[-1]
        ranks = {o.rank for o in self.done if o.size == final}
        return len(ranks) >= final
