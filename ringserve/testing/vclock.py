"""An asyncio event loop in virtual time: timers fire in order, and no time passes while waiting.

The loop is asyncio's own (``SelectorEventLoop``); only its clock and its wait differ. ``time()``
returns a virtual clock, and when the loop has nothing ready and would block in ``select`` until
its next timer, the selector moves the clock to that timer instead and returns at once. So a
simulation whose costs are ``asyncio.sleep``s and ``call_at``s (netsim.py's links) runs as fast as
the CPU allows, and its times are the model's, not the machine's: the same on a loaded 2-core
machine as on an idle 64-core one. Everything that reads the loop's clock follows it: deadlines
(``asyncio.timeout``), the abort grace (``call_later``), the link's pacing.

A loop with nothing scheduled and nothing ready would wait for ever (every task waits for
another): ``select`` raises Deadlock instead.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlock(RuntimeError):
    """Every task waits, and no timer is due: nothing will ever happen."""


class _Selector(selectors.DefaultSelector):
    """A selector that never blocks: a wait for ``timeout`` moves the loop's clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("virtual time: every task waits and no timer is due")
        if timeout > 0:
            self.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """asyncio's loop on a virtual clock (see the module's docstring)."""

    def __init__(self) -> None:
        self._clock = _Selector()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs ``main`` to the end on a fresh virtual-time loop, then closes the loop."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
