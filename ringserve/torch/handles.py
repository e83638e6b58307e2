"""In-flight tensor collectives: their handles, and the names they are tracked by.

``Handle`` is what every async call of ringserve.torch returns (Horovod's handles): pass it to
``synchronize()`` or ``poll()``. ``claim_name`` is the name a named call holds while in flight
(Horovod's "allreduce.<name>"), so that a second call under the same name is refused.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ringserve.torch import basics

__all__ = ["Handle", "claim_name", "poll", "synchronize"]

R = TypeVar("R")


class Handle(Generic[R]):
    """An in-flight collective; pass it to ``synchronize()`` or ``poll()``."""

    def __init__(self, future: concurrent.futures.Future[Any], finish: Callable[[Any], R],
                 parts: Sequence[Handle[Any]] = (), claim: basics.Claim | None = None) -> None:
        self._future = future
        self._finish = finish
        self._parts = tuple(parts)  # collectives this one is made of (a grouped allreduce's)
        self._result: R | None = None
        self._finished = False
        self._claim = claim
        if claim is not None:
            weakref.finalize(self, claim.dropped)  # dropped unwaited: see basics.Claim

    def poll(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        done = self._future.done() and all(part.poll() for part in self._parts)
        if done and self._claim is not None:
            self._claim.taken()  # seen finished: the name is free, as in Horovod
        return done

    def wait(self) -> R:
        """Waits for the collective and returns its result; a second call returns it again."""
        if not self._finished:
            try:
                self._result = self._finish(basics.wait(self._future))
            finally:
                if self._claim is not None:
                    self._claim.taken()
            self._finished = True
        return self._result  # type: ignore[return-value]

    def __call__(self) -> R:
        """The same as wait(): Horovod's sparse_allreduce_async returns a function to call."""
        return self.wait()


def synchronize(handle: Handle[R]) -> R:
    """Waits for an async collective and returns its result (Horovod's ``hvd.synchronize``)."""
    return handle.wait()


def poll(handle: Handle[Any]) -> bool:
    """True if an async collective has finished, so synchronize() will not block."""
    return handle.poll()


def claim_name(kind: str, name: str | None) -> str | None:
    """The name a collective is tracked by while in flight: Horovod's "allreduce.<name>"."""
    return None if name is None else f"{kind}.{name}"
