"""Elastic training at the numpy level: state that commits, restores and syncs, and ``run``.

Horovod's shape:

```python
state = ringserve.elastic.ObjectState(epoch=0, step=0, weights=w)

@ringserve.elastic.run
def train(state):
    while state.step < 1000:
        ...  # collectives
        state.step += 1
        state.commit()

train(state)
```

When a collective fails with a recoverable error (a rank died, the ring changed), ``run``
restores the last commit, waits for the next view, syncs the state from the new view's rank 0 (its
longest-lived member) and calls the function again. At each commit the ranks agree, through one
small allreduce, whether workers are waiting to join or asking to leave (SIGTERM); if so, they
change the world right there, with nothing to roll back.

No silent regression: each sync also asks the coordinator for the job's committed high-water mark
(see ringserve/commits.py). When every worker that held the last commit died before anyone else
received it, the view resumes from the newest durable copy (``RINGSERVE_CHECKPOINT_DIR``, written
by rank 0 of each view) with a warning that names what was lost, or, without one, fails with
StateLostError on every rank instead of starting again from a fresh process's state (the
decision is commits.py's, its effects resume.py's).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeVar

import numpy as np

from ringserve import api
from ringserve.commits import Commit
from ringserve.constants import THREAD_WAIT_SLACK_S
from ringserve.elastic import resume, rider
from ringserve.elastic.checkpoint import CheckpointWriter
from ringserve.errors import (
    STATE_LOST_EXIT_CODE,
    CollectiveTimeoutError,
    CoordinatorUnreachableError,
    CorruptFrameError,
    HostsUpdatedInterrupt,
    RecoverableError,
    RendezvousTimeoutError,
    StateLostError,
)
from ringserve.worker.faces.elastic import no_view_within
from ringserve.worker.runtime import Worker

log = logging.getLogger("ringserve.elastic")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


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


class _StateLostExit:
    """Makes a process that ends on an uncaught StateLostError exit with STATE_LOST_EXIT_CODE.

    Python exits with 1 after any uncaught exception; ``ringserve run`` must tell this one apart,
    so as to restart nobody (a restarted process would hold even less). The hook prints the
    traceback as usual, leaves the world, and exits with the code. Caught, the error changes
    nothing.
    """

    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            previous(kind, value, tb)
            if isinstance(value, StateLostError):
                try:
                    api.shutdown()
                finally:
                    logging.shutdown()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(STATE_LOST_EXIT_CODE)

        sys.excepthook = hook


class State:
    """Base of elastic state: commit, restore, sync and reset callbacks.

    Subclasses implement ``save`` (remember the current values), ``restore`` (go back to them),
    ``take`` (take a rank's saved values, with ``commits`` and ``lineage``), and, for durable
    copies, ``snapshot`` and ``load_snapshot``. ``sync`` decides whose values the view takes.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0
        # Goes up by one each time a world resumes from a durable copy (see commits.py).
        self.lineage = 0
        # On rank 0: the commit this process found held by no member of its view, and since when
        # (time.monotonic()), so that the wait for its holders is bounded across syncs.
        self.loss_seen: tuple[Commit, float] | None = None
        self._writer: CheckpointWriter | None = None
        self._check: _Check | None = None  # the last commit's pipelined check, while its answer is not taken
        self.holding: tuple[int, ...] = ()  # set by each sync (resume.agree_root)
        # Set by a restore that found this rank's commit gone (a commit in place whose tensors
        # moved on, see TorchState): it holds no commit of the job, as a fresh process.
        self.dropped = False
        # A sync's sends of the state to the ranks that lacked it, which the root does not wait for
        # (TorchState.take): a commit takes those that are over, the end of ``run`` and the next
        # sync wait for every one.
        self.handoffs: list[concurrent.futures.Future[None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Callbacks run after every change of the world (for instance to rescale a learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state, then changes the world here if workers wait to join or want to leave.

        Whether they do is agreed by one small allreduce, and that check is pipelined: a commit
        starts its check and returns, and the next commit (or the end of ``run``'s function) takes
        the answer, which is in by then. The check finishing proves that every rank saved this
        commit, so it is then reported to the coordinator (by rank 0 at once, on the worker's
        loop), and written to the checkpoint directory at the next commit. When the answer says
        that the world changes, it changes at that next commit, after its save, with the check
        done in line (``check_host_updates``): a join or a leave waits one commit more, and a
        step costs no wait for the slowest rank's commit.

        Raises:
            HostsUpdatedInterrupt: the world changes at this commit (``run`` handles it).
        """
        rider.heal()  # a joiner's state that no optimizer step took in yet (rider.py)
        changes = self._agreed(functools.partial(self._settle, final=False))
        self.save()
        self.commits += 1
        worker = api.context().worker
        view, rank = worker.running_view, worker.rank  # the commit's, before it can change the world
        if not changes:
            self._check = _Check.start(Commit(self.lineage, self.commits), view, rank, ride=self.rides())
            return
        try:
            self._agreed(self.check_host_updates)
        except HostsUpdatedInterrupt:
            self._confirmed(view, rank, world_changes=True)
            raise
        self._confirmed(view, rank, world_changes=False)

    def _settle(self, *, final: bool = True) -> bool:
        """Takes the answer of the last commit's pipelined check, if one is out; returns whether
        the world changes at this commit.

        Raises:
            RecoverableError: the check failed (a rank died, the ring changed): ``run`` restores
                the last commit, which every survivor saved before the check.
        """
        self._handed_off(everything=final)
        check, self._check = self._check, None
        if check is None:
            return False
        changes = check.changes()
        self._checkpoint(check.rank)
        return changes

    def finish(self) -> None:
        """Takes the answer of the last commit's check: ``run`` calls this when the function
        returns, so that its last commit is confirmed and written like the others."""
        rider.heal()
        self._agreed(self._settle)

    def drop_check(self) -> None:
        """Forgets the last commit's check: a sync (after a restore, or at ``run``'s start) reports
        what the world then holds. The last sync's sends are over by then: they failed with their
        view, or went through (their errors were the view's, and the sync says what it does now)."""
        self._check = None
        rider.withdraw()
        rider.drop_heal()
        self._handed_off(raising=False)

    def _handed_off(self, *, raising: bool = True, everything: bool = True) -> None:
        """Waits for every one of the last sync's sends of the state (a root's, see TorchState.take);
        without ``everything`` (at a commit that is not the last), only takes those that are over:
        the others may go on into the steps that follow, and the last commit or the next sync waits
        for them (a root must not close a link under them).

        Raises:
            RecoverableError: with ``raising``, the first send that failed (its receiver died, the
                view changed), once all of them are over (or, without ``everything``, of those over).
        """
        handoffs, self.handoffs = self.handoffs, []
        if not everything:
            self.handoffs = [h for h in handoffs if not h.done()]
            handoffs = [h for h in handoffs if h.done()]
        failed: BaseException | None = None
        for handoff in handoffs:
            try:
                api.context().wait(handoff)
            except Exception as exc:  # every send is waited for; the first error is raised
                failed = failed or exc
        if failed is not None and raising:
            raise failed

    def _agreed(self, action: Callable[[], T]) -> T:
        """Runs ``action``, a step of a commit or a sync that can fail on some ranks and pass on
        others. A state whose ranks must fail together overrides it (hsdp's replica groups)."""
        return action()

    def rides(self) -> bool:
        """Whether the next step's gradient allreduce can carry a commit's check (see
        ringserve.elastic.rider): a state whose optimizer does says so; it must say the same on
        every rank."""
        return False

    def _confirmed(self, view: int, rank: int, *, world_changes: bool) -> None:
        """The commit-time allreduce of ``view`` finished: every rank of it entered it after saving,
        so all of them hold this commit. Reported to the coordinator (heartbeats), and written to
        the checkpoint directory by rank 0 every checkpoint_every commits."""
        ctx = api.context()
        commit = Commit(self.lineage, self.commits)
        wait_s = ctx.config.rpc_timeout_s
        ctx.call(lambda w: _report(w, w.committed, commit, view, rank, now=world_changes, wait_s=wait_s),
                 timeout_s=wait_s + THREAD_WAIT_SLACK_S)
        self._checkpoint(rank)

    def _checkpoint(self, rank: int) -> None:
        """Rank 0 of the commit's view writes the saved state, confirmed, every checkpoint_every commits."""
        cfg = api.context().config
        if cfg.checkpoint_dir and rank == 0 and self.commits % cfg.checkpoint_every == 0:
            if self._writer is None:
                self._writer = CheckpointWriter(resume.store(cfg.checkpoint_dir, cfg.checkpoint_keep))
            self._writer.submit(Commit(self.lineage, self.commits), pickle.dumps(self.snapshot(), protocol=5))

    def close_checkpoints(self, timeout_s: float) -> None:
        """Waits for the last checkpoint write, then stops the writer's thread."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close(timeout_s)

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank, or on none: the ranks agree by an allreduce.

        Each rank adds what its heartbeats say of waiting workers and whether it wants to leave;
        one allreduce of those two numbers is the decision everyone shares. Only after it, when
        every rank has finished the step, does rank 0 ask the coordinator to admit the waiting
        workers and to let the leavers go, which always yields one new view for the whole change.

        The leavers are named (one allgather, only at a commit where someone leaves): left to
        their own Leave calls, each after its drain, they would go one view each, and the
        survivors would sync in a view that still holds the next leaver, whose departure then
        fails that sync and makes them restore.
        """
        ctx = api.context()
        worker = ctx.worker
        # The commit's view and this rank in it, read now: the view that this commit makes can be
        # installed before the request below goes, and a rank that is rank 0 there must not ask again.
        view, rank = worker.running_view, worker.rank
        leave = _Leave.requested.is_set()
        mine = _flags(worker, leave)
        agreed = ctx.call(lambda w: w.allreduce(mine, op="max", name=HOSTS))
        joining, leaving = int(agreed[0]), int(agreed[1])
        if not (joining or leaving):
            return
        leavers: list[str] = []
        if leaving:
            # Set before the allgather: rank 0 asks only once every rank has entered it, so a
            # leaver knows it leaves before a heartbeat can hear that the coordinator dropped it.
            worker.leaving = leave
            try:
                ids = api.allgather_object(worker.worker_id if leave else "", name="ringserve.elastic.leavers")
            except BaseException:
                worker.leaving = False  # it stays in this world after all (until its next commit)
                raise
            leavers = [str(i) for i in ids if i]
            if joining and len(leavers) == worker.size:
                # Every holder of the state would go, and the joiners would get it from nobody:
                # all stay one more commit, which the joiners reach holding the state.
                log.warning("%s: every member leaves at this commit while %d worker(s) wait to join; "
                            "they leave at the next one, once the joiners hold the state", worker.tag, joining)
                worker.leaving, leavers = False, []
        if rank == 0:
            try:
                _admit(leavers, view, retry=not leavers)
            except CoordinatorUnreachableError as exc:
                if not leavers:
                    raise
                # Their own Leave calls, once the coordinator is back, still end this world.
                log.warning("%s: could not ask the coordinator to let %d worker(s) go at this commit (%s); "
                            "they leave by themselves", worker.tag, len(leavers), exc)
        raise HostsUpdatedInterrupt(joining, len(leavers))

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def take(self, root: int) -> None:
        """Every rank takes ``root``'s saved values, ``commits`` and ``lineage``, and restores them."""
        raise NotImplementedError

    def snapshot(self) -> object:
        """The saved values, picklable, for a durable copy."""
        raise NotImplementedError

    def load_snapshot(self, snapshot: object) -> None:
        """Makes ``snapshot`` (from ``snapshot()``) the saved values; ``restore`` then applies them."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank hold the same state: the furthest commit any member holds.

        Raises:
            StateLostError: no member holds the job's last commit and no durable copy exists.
        """
        self.drop_check()
        root = self._agreed(lambda: resume.agree_root(self))
        self._agreed(lambda: self.take(root))
        api.context().worker.report_committed(Commit(self.lineage, self.commits), now=True)

class ObjectState(State):
    """Elastic state of picklable attributes, synced with broadcast_object.

    Example:
        ```python
        state = ObjectState(epoch=0, weights=np.zeros(10))
        state.epoch += 1
        state.commit()
        ```
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

    def take(self, root: int) -> None:
        payload = api.broadcast_object((self.commits, self.lineage, self._saved), root=root, name="ringserve.elastic.sync")
        assert isinstance(payload, tuple)
        self.commits, self.lineage, self._saved = payload
        self.restore()

    def snapshot(self) -> object:
        return self._saved

    def load_snapshot(self, snapshot: object) -> None:
        assert isinstance(snapshot, dict)
        self._saved = snapshot


HOSTS = "ringserve.elastic.hosts"  # the name of a commit's check


def _flags(worker: Worker, leave: bool) -> np.ndarray:
    """What this rank adds to a commit's check: how many workers its heartbeats say wait to join,
    and whether it wants to leave (SIGTERM). Their maximum over the ranks is the decision."""
    return np.array([worker.pending_workers, 1 if leave else 0], dtype=np.int64)


async def _report(w: Worker, held: Commit | None, commit: Commit, view: int, rank: int, *, now: bool,
                  wait_s: float) -> None:
    """Reports ``commit``, which every rank of ``view`` holds, in place of ``held``; nothing when
    the worker no longer holds ``held`` (a sync reported since). Rank 0 first waits until the
    coordinator has recorded ``held``: the mark may trail the world by this commit, never by two
    (see worker/control/reports.py). Rank 0's report goes at once, and everyone's where it
    matters: before the world changes (``now``: the next view may admit workers holding nothing)
    and at the first commit (until then the mark says 0, which no fresh process could be found
    to fall short of). Else with the next heartbeat."""
    if rank == 0 and held is not None:
        await w.wait_reported(held, wait_s)
    if w.committed == held:
        w.report_committed(commit, view=view, now=now or rank == 0 or commit.step == 1)


class _Check:
    """A commit's check, pipelined: the allreduce of every rank's flags (``_flags``) and then the
    commit's report, on the worker's loop while training goes on. Where the state's optimizer
    can carry the flags (``State.rides``), the next step's gradient allreduce does (see
    ringserve.elastic.rider), the report starts once it is back, and the check's own allreduce
    runs only when no allreduce carried them by the next commit."""

    def __init__(self, commit: Commit, view: int, rank: int) -> None:
        ctx = api.context()
        self.rank = rank  # the commit's rank
        self._commit, self._view = commit, view
        self._mine, self._held = _flags(ctx.worker, _Leave.requested.is_set()), ctx.worker.committed
        self._ride: rider.Ride | None = None
        self._future: concurrent.futures.Future[np.ndarray] | None = None

    @classmethod
    def start(cls, commit: Commit, view: int, rank: int, *, ride: bool) -> _Check:
        check = cls(commit, view, rank)
        if ride:
            check._ride = rider.Ride(check._mine, on_answer=check._carried)
            rider.publish(check._ride)
        else:
            check._future = api.context().submit(check._own)
        return check

    async def _own(self, w: Worker) -> np.ndarray:
        agreed = await w.allreduce(self._mine, op="max", name=HOSTS)
        await self._report(w)
        return agreed

    async def _report(self, w: Worker) -> np.ndarray:
        await _report(w, self._held, self._commit, self._view, self.rank, now=False,
                      wait_s=api.context().config.rpc_timeout_s)
        return np.zeros(rider.SLOTS, dtype=np.int64)

    def _carried(self) -> None:
        self._future = api.context().submit(self._report)

    def changes(self) -> bool:
        """Whether some rank saw workers waiting to join, or wants to leave.

        Raises:
            RecoverableError: the check failed.
        """
        ctx = api.context()
        if self._ride is not None:
            rider.withdraw()
            if self._ride.answer is None:  # nothing carried it (no optimizer step since the commit)
                return bool(ctx.wait(ctx.submit(self._own)).any())
            if self._future is not None:
                ctx.wait(self._future)
            return bool(self._ride.answer.any())
        assert self._future is not None
        return bool(ctx.wait(self._future).any())


ADMIT_RETRY_S = 0.5  # between rank 0's requests to admit, while the coordinator does not answer


def _admit(leavers: list[str], view: int, *, retry: bool) -> None:
    """Rank 0 asks the coordinator to admit the waiting workers (and let ``leavers`` go) at the
    commit of ``view``. Every other rank has already decided that the world changes here and
    waits for the view this request makes: with ``retry``, a coordinator that does not answer
    (it is restarting) is asked again until elastic_timeout_s has passed, the bound the others
    wait within, rather than leaving them to wait out that bound for a view nobody asked for.

    Raises:
        CoordinatorUnreachableError: the coordinator did not answer (within elastic_timeout_s
            with ``retry``).
    """
    ctx = api.context()
    deadline = time.monotonic() + ctx.config.elastic_timeout_s
    while True:
        try:
            ctx.call(lambda w: w.admit_waiting(leavers, view_id=view))
            return
        except CoordinatorUnreachableError as exc:
            if not retry or time.monotonic() + ADMIT_RETRY_S >= deadline:
                raise
            log.warning("%s: the coordinator did not take the request to admit the waiting workers (%s); "
                        "asking again", ctx.worker.tag, exc)
            time.sleep(ADMIT_RETRY_S)


def _leave_now(state: State, view: int) -> None:
    ctx = api.context()
    # Rank 0 asked the coordinator to let this worker go (with the others leaving at this commit)
    # in the view that ends ``view``: that view is waited for (up to rpc_timeout_s), so that the
    # worker's own Leave at shutdown (a no-op then, a fallback else) cannot overtake the request
    # and make a view of its own, in which the survivors would sync without the next leaver.
    deadline = time.monotonic() + ctx.config.rpc_timeout_s
    while ctx.worker.latest_view <= view and time.monotonic() < deadline:
        time.sleep(0.005)
    _exit(state, "leaving the world after a commit, as SIGTERM asked")


def _exit(state: State, why: str) -> NoReturn:
    log.warning(why)
    state.close_checkpoints(api.context().config.checkpoint_timeout_s)
    api.shutdown()
    sys.exit(0)


LEAVE_POLL_S = 0.25  # how often a worker waiting for a view checks for SIGTERM


def wait_for_view_after(view: int, state: State) -> None:
    """Waits up to elastic_timeout_s for a view newer than ``view``; a SIGTERM meanwhile ends the
    worker (exit 0) at once.

    Between views the state is at its last commit (kept at a commit, restored after a failure),
    which is all a leave at the next commit would keep. And the next commit may never come: when
    SIGTERM reached every member but came to some just after the commit's flags were read (a
    `docker compose down`, a job stopped), the others left at that commit, and the view this
    worker waits for would hold only itself, below min_workers: it would wait out the elastic
    timeout for nothing.

    Raises:
        RendezvousTimeoutError: no such view within elastic_timeout_s.
    """
    ctx = api.context()
    timeout = ctx.config.elastic_timeout_s
    deadline = time.monotonic() + timeout
    while True:
        if _Leave.requested.is_set():
            _exit(state, "SIGTERM while waiting for a new view: leaving now, with the state of the last commit")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeoutError(no_view_within(ctx.worker.address, view, timeout))
        step = min(LEAVE_POLL_S, left)

        def wait(w: Worker, step: float = step) -> Coroutine[Any, Any, int]:
            return w.wait_for_view(view, step)

        try:
            # The worker's own deadline (RendezvousTimeoutError) comes first; this one is a backstop.
            ctx.call(wait, timeout_s=step + THREAD_WAIT_SLACK_S)
            return
        except RendezvousTimeoutError:
            continue
        except CollectiveTimeoutError:
            # The backstop fired: the worker's loop did not answer one poll within the slack, a
            # process starved of CPU (256 workers on 2 cores at a load of 600 did this to 239 of
            # them, which died of it). Not the wait's failure: elastic_timeout_s bounds it.
            log.warning("%s: the worker's loop did not answer within %g s while waiting for a view "
                        "newer than %d (a starved process); waiting on", ctx.worker.address,
                        step + THREAD_WAIT_SLACK_S, view)
            continue


CORRUPT_RETRIES = 3  # damaged frames with no commit in between (checksums on) before the error is raised


def run(func: F) -> F:
    """Wraps a training function ``func(state, *args, **kwargs)`` for elastic training.

    On a RecoverableError the state goes back to its last commit; on HostsUpdatedInterrupt it is
    kept. Either way the wrapper waits (up to elastic_timeout_s) for a view that includes this
    worker and is newer than the one that ended, syncs the state from the rank holding the
    furthest commit (or, if the view lost every holder of the job's last commit, from the newest
    checkpoint) and runs ``func`` again. A CorruptFrameError (checksums on) ends no view: every rank restores its last commit
    and runs again in the same view, up to CORRUPT_RETRIES times without a commit in between. A
    worker that got SIGTERM leaves at its commit and exits with code 0. When it returns or
    raises, it waits (up to checkpoint_timeout_s) for the last checkpoint to be written.

    Raises:
        RendezvousTimeoutError: no new view came within elastic_timeout_s (for instance, the
            survivors stayed below min_workers).
        StateLostError: every worker holding the job's last commit died and no durable copy
            exists (raised on every rank). Left uncaught, it ends the process with exit code
            STATE_LOST_EXIT_CODE (65), which ``ringserve run`` recognizes: it restarts nobody
            and ends the run with that code.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        _Leave.install()
        _StateLostExit.install()
        timeout_s = api.context().config.checkpoint_timeout_s
        try:
            return _run(func, state, args, kwargs)
        finally:
            rider.withdraw()  # a ride published by a commit of a run that ended on an error stays unridden
            rider.drop_heal()
            state.close_checkpoints(timeout_s)

    return wrapper  # type: ignore[return-value]


def _run(func: Callable[..., Any], state: State, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ctx = api.context()
    worker = ctx.worker
    # A worker that came to a running world is ready now (its model, optimizer and data are
    # built): it asks to be admitted and waits for the members' next commit to take it in, so
    # that they never wait for what the script did after init (WorkerConfig.admit_when_ready).
    ctx.call(lambda w: w.ready_to_join(), timeout_s=ctx.config.rendezvous_timeout_s + THREAD_WAIT_SLACK_S)
    corrupt, corrupt_at = 0, -1  # damaged frames since the commit numbered corrupt_at
    reset = False  # the reset callbacks are due (after the first failure)
    while True:
        view = worker.latest_view
        same_view = False
        try:
            # Pinned before the reset callbacks and the sync, so that they, and the steps after
            # them, all run in the one view (RingChangedError here if we are in none): what the
            # callbacks register (process sets) belongs to the view the state is synced in, and a
            # view change under them is one more reset.
            view = worker.view_id
            worker.pin_view(view)
            if reset:
                state.on_reset()
                reset = False
            state.sync()
            result = func(state, *args, **kwargs)
            state.finish()
            return result
        except HostsUpdatedInterrupt as exc:
            # Only a worker that was named a leaver at this commit goes: a SIGTERM that came after
            # its flag was read leaves at its next commit (the coordinator keeps it in this world).
            if exc.leaving and worker.leaving:
                _leave_now(state, view)
            log.info("%s: the world changes at a commit (%s); waiting for a newer view", worker.tag, exc)
        except CorruptFrameError as exc:
            # Every rank aborted the collective and the ring is intact: no new view will come.
            corrupt = corrupt + 1 if state.commits == corrupt_at else 1
            corrupt_at = state.commits
            if corrupt > CORRUPT_RETRIES:
                raise
            log.warning("%s: %s; restoring the last commit and retrying in the same view (%d of %d)",
                        worker.tag, exc, corrupt, CORRUPT_RETRIES)
            state.restore()  # the sync that follows drops the last commit's check
            same_view = True
        except RecoverableError as exc:
            log.warning("%s: %s; restoring the last commit", worker.tag, exc)
            state.restore()
        finally:
            worker.pin_view(None)
        if not same_view:
            wait_for_view_after(view, state)
        reset = True

