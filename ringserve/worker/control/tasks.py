"""The owner of a worker's background tasks: each one is started here, and ends here.

The worker's loops (the view watch, the heartbeats) run for its whole life, and a report to the
coordinator runs for a moment; nobody awaits them while they run. So a crash would go unseen until
``close()`` awaited the task, and a crashed heartbeat once went unnoticed until then, when its
exception made ``close()`` stop half-way with channels and the server still open. Here:

- a crash (any exception but a cancellation) is reported the moment the task ends, once, through
  ``on_crash(name, exc)``: the worker then fails its waiters and collectives with an error that
  chains the cause (see ``Worker._fail``);
- ``close()`` cancels every task still running and awaits them all, within a deadline, and never
  raises what they raised: that was reported already. A task that does not end within the
  deadline (it swallows cancellation) is named in a log line, not waited for forever.

Example:
    ```python
    tasks = TaskOwner(on_crash=lambda name, exc: print(name, "crashed:", exc))
    tasks.spawn(heartbeat_loop(), "heartbeat")
    ...
    await tasks.close(timeout_s=1.0)
    ```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("ringserve.worker")

OnCrash = Callable[[str, BaseException], None]


class TaskOwner:
    """Starts tasks, surfaces their crashes, and cancels and awaits them at the end."""

    def __init__(self, on_crash: OnCrash) -> None:
        self._on_crash = on_crash
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._closing = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Runs ``coro`` as a task owned here; ``name`` says what it is in the crash report.

        Raises:
            RuntimeError: the owner is closing (nothing new starts then).
        """
        if self._closing:
            coro.close()
            raise RuntimeError(f"The worker is shutting down: its {name} task was not started.")
        task = asyncio.get_running_loop().create_task(coro, name=f"ringserve-{name}")
        self._tasks[task] = name
        task.add_done_callback(self._done)
        return task

    @property
    def running(self) -> list[str]:
        """The names of the tasks still running."""
        return sorted(self._tasks.values())

    def _done(self, task: asyncio.Task[Any]) -> None:
        name = self._tasks.pop(task, "task")
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("the worker's %s task crashed", name, exc_info=exc)
        if not self._closing:  # while closing, the worker is going down anyway: logged, not reported
            self._on_crash(name, exc)

    async def close(self, timeout_s: float) -> None:
        """Cancels every task and waits (up to ``timeout_s``) for all of them to end."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        if pending:
            log.error("worker tasks %s did not end within %g s of being cancelled",
                      sorted(t.get_name() for t in pending), timeout_s)
