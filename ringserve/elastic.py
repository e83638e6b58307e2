"""Elastic training at the numpy level: state that commits, restores and syncs, and ``run``.

Horovod's shape::

    state = ringserve.elastic.ObjectState(epoch=0, step=0, weights=w)

    @ringserve.elastic.run
    def train(state):
        while state.step < 1000:
            ...  # collectives
            state.step += 1
            state.commit()

    train(state)

When a collective fails with a recoverable error (a rank died, the ring changed), ``run``
restores the last commit, waits for the next view, syncs the state from the new view's rank 0 (its
longest-lived member) and calls the function again. At each commit the ranks agree, through one
small allreduce, whether workers are waiting to join or asking to leave (SIGTERM); if so, they
change the world right there, with nothing to roll back.
"""

from __future__ import annotations

import copy
import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from ringserve import api
from ringserve.errors import CorruptFrameError, HostsUpdatedInterrupt, RecoverableError
from ringserve.worker.runtime import Worker

log = logging.getLogger("ringserve.elastic")

F = TypeVar("F", bound=Callable[..., Any])


class _Leave:
    """Set by SIGTERM: this worker leaves at its next commit."""

    requested = threading.Event()

    @classmethod
    def install(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum: int, frame: object) -> None:
            log.warning("SIGTERM: this worker leaves at its next commit")
            cls.requested.set()

        if previous is not handler:
            signal.signal(signal.SIGTERM, handler)


class State:
    """Base of elastic state: commit, restore, sync and reset callbacks.

    Subclasses implement ``save`` (remember the current values), ``restore`` (go back to them)
    and ``sync`` (take rank 0's values).
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Callbacks run after every change of the world (for instance to rescale a learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state, then changes the world here if workers wait to join or want to leave.

        Raises:
            HostsUpdatedInterrupt: the world changes at this commit (``run`` handles it).
        """
        self.save()
        self.commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank, or on none: the ranks agree by an allreduce.

        Each rank adds what its heartbeats say of waiting workers and whether it wants to leave;
        one allreduce of those two numbers is the decision everyone shares. Only after it, when
        every rank has finished the step, does rank 0 ask the coordinator to admit the waiting
        workers, which always yields a new view.
        """
        ctx = api.context()
        worker = ctx.worker
        mine = np.array([worker.pending_workers, 1 if _Leave.requested.is_set() else 0], dtype=np.int64)
        agreed = ctx.call(lambda w: w.allreduce(mine, op="max", name="ringserve.elastic.hosts"))
        joining, leaving = int(agreed[0]), int(agreed[1])
        if joining and worker.rank == 0:
            ctx.call(lambda w: w.admit_waiting())
        if joining or leaving:
            raise HostsUpdatedInterrupt(joining, leaving)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


def sync_root(commits: int) -> int:
    """The rank whose state everyone takes: the lowest rank among those with the most commits.

    That is rank 0, the longest-lived member, unless a rank that survived with it committed once
    more before the old view broke (a collective can finish on some ranks and fail on others):
    taking the furthest commit means no committed step is ever lost.
    """
    counts = api.allgather(np.array([commits], dtype=np.int64), name="ringserve.elastic.commits")
    return int(np.argmax(counts))


class ObjectState(State):
    """Elastic state of picklable attributes, synced with broadcast_object.

    Example::

        state = ObjectState(epoch=0, weights=np.zeros(10))
        state.epoch += 1
        state.commit()
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        self._saved = copy.deepcopy(self.values())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self) -> None:
        root = sync_root(self.commits)
        payload = api.broadcast_object((self.commits, self._saved), root=root, name="ringserve.elastic.sync")
        assert isinstance(payload, tuple)
        self.commits, self._saved = payload
        self.restore()


def _leave_now() -> None:
    log.warning("leaving the world after a commit, as SIGTERM asked")
    api.shutdown()
    sys.exit(0)


def _wait_for_view_after(view: int) -> None:
    ctx = api.context()

    timeout = ctx.config.elastic_timeout_s

    def wait(w: Worker) -> Coroutine[Any, Any, int]:
        return w.wait_for_view(view, timeout)

    # The worker's own deadline (RendezvousTimeoutError) comes first; this one is a backstop.
    ctx.call(wait, timeout_s=timeout + 10.0)


CORRUPT_RETRIES = 3  # damaged frames with no commit in between (checksums on) before the error is raised


def run(func: F) -> F:
    """Wraps a training function ``func(state, *args, **kwargs)`` for elastic training.

    On a RecoverableError the state goes back to its last commit; on HostsUpdatedInterrupt it is
    kept. Either way the wrapper waits (up to elastic_timeout_s) for a view that includes this
    worker and is newer than the one that ended, syncs the state from rank 0 and runs ``func``
    again. A CorruptFrameError (checksums on) ends no view: every rank restores its last commit
    and runs again in the same view, up to CORRUPT_RETRIES times without a commit in between. A
    worker that got SIGTERM leaves at its commit and exits with code 0.

    Raises:
        RendezvousTimeoutError: no new view came within elastic_timeout_s (for instance, the
            survivors stayed below min_workers).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        _Leave.install()
        ctx = api.context()
        worker = ctx.worker
        corrupt, corrupt_at = 0, -1  # damaged frames since the commit numbered corrupt_at
        while True:
            view = worker.latest_view
            same_view = False
            try:
                # Pinned before the sync, so that the sync's collectives and the steps after it
                # all run in the one view (RingChangedError here if we are in none).
                view = worker.view_id
                worker.pin_view(view)
                state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                if exc.leaving and _Leave.requested.is_set():
                    _leave_now()
                log.info("%s: the world changes at a commit (%s); waiting for a newer view", worker.tag, exc)
            except CorruptFrameError as exc:
                # Every rank aborted the collective and the ring is intact: no new view will come.
                corrupt = corrupt + 1 if state.commits == corrupt_at else 1
                corrupt_at = state.commits
                if corrupt > CORRUPT_RETRIES:
                    raise
                log.warning("%s: %s; restoring the last commit and retrying in the same view (%d of %d)",
                            worker.tag, exc, corrupt, CORRUPT_RETRIES)
                state.restore()
                same_view = True
            except RecoverableError as exc:
                log.warning("%s: %s; restoring the last commit", worker.tag, exc)
                state.restore()
            finally:
                worker.pin_view(None)
            if not same_view:
                _wait_for_view_after(view)
            state.on_reset()

    return wrapper  # type: ignore[return-value]
