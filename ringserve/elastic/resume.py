"""The effects of an elastic sync's decision: ask the coordinator for the job's mark, agree on it
with one allgather, and, when no member of the view holds the last commit, first look for its
holders (they may have been declared dead while alive, and come back), and only once they are
gone, resume from a durable copy or raise StateLostError on every rank. The decisions themselves
are commits.py's, pure.

``State.sync`` (ringserve.elastic) calls ``agree_root`` before it takes the chosen rank's state;
what a sync reads and sets of that state is ``Synced``, declared here, so that this module knows
nothing of state.py, which builds on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ringserve import api, commits
from ringserve.commits import Commit
from ringserve.constants import THREAD_WAIT_SLACK_S
from ringserve.elastic.checkpoint import COORDINATOR, CheckpointStore, CoordinatorStore
from ringserve.errors import HostsUpdatedInterrupt, RingserveError, StateLostError

if TYPE_CHECKING:
    from ringserve.worker.runtime import Worker

log = logging.getLogger("ringserve.elastic")


class Synced(Protocol):
    """What a sync reads and sets of the elastic state (``ringserve.elastic.State`` is one)."""

    commits: int
    lineage: int
    # On rank 0: the commit found held by no member of its view, and since when (time.monotonic()).
    loss_seen: tuple[Commit, float] | None
    # The ranks that hold the commit the view takes, where it is one of the job's commits (not a
    # fresh process's state, which differs from rank to rank): they hold the same state already.
    holding: tuple[int, ...]
    # Whether this rank's restore found its commit gone (it then holds no commit, as a fresh process).
    dropped: bool

    def load_snapshot(self, snapshot: object) -> None: ...

    def restore(self) -> None: ...


def agree_root(state: Synced) -> int:
    """The rank whose state the view takes; every rank returns the same one.

    Each rank asks the coordinator for the job's mark (falling back on the last heartbeat's), and
    one allgather shares what every rank holds and heard: the decision then has the same inputs
    everywhere. After a loss, ``state`` holds the durable copy on rank 0 and a new lineage. Sets
    ``state.holding``: which ranks hold the chosen commit already (none after a loss).

    Raises:
        HostsUpdatedInterrupt: no member holds the job's last commit, but a worker that held it
            is back (it was declared dead while alive); rank 0 asked for it to be admitted, and
            the state is synced again in the view that takes it.
        StateLostError: no member holds the job's last commit, every worker that held it is
            gone (or none came back within holder_wait_s), and no durable copy exists.
    """
    ctx = api.context()
    state.holding = ()
    mark = ctx.call(lambda w: w.commit_mark(), timeout_s=ctx.config.rpc_timeout_s + THREAD_WAIT_SLACK_S)
    m = mark.commit
    known = (m.lineage, m.step, 1) if m is not None else (0, 0, 0)
    reported = ctx.worker.committed
    # 0: it reported nothing (a fresh process), or its restore found its commit gone (it holds
    # none, and is no new state either); 1: it holds less than it reported (a new state); 2: it
    # holds what it reported, or more.
    renewed = (0 if reported is None or state.dropped
               else 1 if Commit(state.lineage, state.commits) < reported else 2)
    row = np.array([state.lineage, state.commits, *known, renewed], dtype=np.int64)
    rows = api.allgather(row, name="ringserve.elastic.commits").reshape(-1, 6)
    held = [Commit(int(r[0]), int(r[1])) for r in rows]
    marks = [Commit(int(r[2]), int(r[3])) for r in rows if r[4]]
    plan = commits.plan_sync(held, max(marks) if marks else None, [None if r[5] == 0 else bool(r[5] == 1) for r in rows])
    if isinstance(plan, commits.TakeRoot):
        state.loss_seen = None
        if held[plan.root].step > 0:  # a commit of the job (step 0: each rank's own fresh or renewed state)
            state.holding = tuple(r for r, c in enumerate(held) if c == held[plan.root])
        return plan.root
    if isinstance(plan, commits.Renew):
        log.info("%s: every member holds a new elastic state; it starts lineage %d", ctx.worker.tag, plan.lineage)
        state.loss_seen = None
        state.lineage = plan.lineage
        return plan.root
    mark, why = _await_holders(state, plan, mark)
    return _after_loss(state, plan, mark, why)


def _await_holders(state: Synced, lost: commits.Lost, mark: commits.Mark) -> tuple[commits.Mark, str]:
    """Rank 0 looks for the holders of the lost commit until they are back or gone (within
    holder_wait_s) and tells everyone; the others wait in the broadcast meanwhile.

    Returns:
        The mark as last heard (its holders name the loss), and what was seen of the holders.

    Raises:
        HostsUpdatedInterrupt: on every rank, when a holder is back; rank 0 then asks for it to
            be admitted: the next view takes it, and the sync runs again there.
    """
    ctx = api.context()
    worker, cfg = ctx.worker, ctx.config
    view, rank = worker.view_id, worker.rank  # read now: rank 0's request below makes the next view
    news: tuple[str, commits.Mark, str] | None = None
    if rank == 0:
        now = time.monotonic()
        if state.loss_seen is None or state.loss_seen[0] != lost.mark:
            state.loss_seen = (lost.mark, now)
        since = state.loss_seen[1]
        bound = cfg.holder_wait_bound_s
        budget = max(0.0, bound - (now - since)) + 2 * cfg.rpc_timeout_s + THREAD_WAIT_SLACK_S
        verdict, mark = ctx.call(lambda w: _look_for_holders(w, lost.mark, mark, since, bound), timeout_s=budget)
        if isinstance(verdict, commits.Readmit):
            news = ("readmit", mark, ", ".join(h.describe() for h in verdict.holders))
        else:
            assert isinstance(verdict, commits.Gone)
            news = ("gone", mark, verdict.why)
    shared = api.broadcast_object(news, root=0, name="ringserve.elastic.holders")
    assert isinstance(shared, tuple)
    kind, mark, detail = shared
    if kind == "readmit":
        message = (f"No member of view {view} holds {lost.mark}, but its holder is back ({detail}): "
                   "it was dropped while alive; syncing again in the view that admits it")
        log.warning("%s: %s", worker.tag, message)
        if rank == 0:
            # Only now that every rank has the news: the new view ends this one's collectives.
            ctx.call(lambda w: w.admit_waiting(view_id=view))
        raise HostsUpdatedInterrupt(1, 0, message)
    return mark, detail


async def _look_for_holders(worker: Worker, lost: Commit, mark: commits.Mark, since: float,
                            bound_s: float) -> tuple[commits.Readmit | commits.Gone, commits.Mark]:
    """Looks at the holders of ``lost`` once a heartbeat interval until judge_holders says they are
    back or gone; returns that verdict and the mark last heard."""
    first = True
    while True:
        holders = mark.holders if mark.commit is not None and mark.commit >= lost else ()
        absent = [h for h in holders if h.worker_id not in mark.present]
        sights = dict(zip([h.worker_id for h in absent],
                          await asyncio.gather(*(worker.sight(h.worker_id, h.address) for h in absent)), strict=True))
        seen = [(h, sights.get(h.worker_id, commits.Seen.BACK)) for h in holders]
        verdict = commits.judge_holders(seen, time.monotonic() - since, bound_s)
        if not isinstance(verdict, commits.Await):
            return verdict, mark
        # Said once as a warning (an operator sees why the world pauses), then at each look.
        log.log(logging.WARNING if first else logging.INFO,
                "%s: no member of view %d holds %s; waiting up to %g s (holder_wait_s) for its holders: %s",
                worker.tag, worker.view_id, lost, bound_s, "; ".join(f"worker {h.worker_id[:8]} {s.value}" for h, s in seen))
        first = False
        await asyncio.sleep(worker.heartbeat_interval_s)
        fresh = await worker.commit_mark()
        # A mark without holders is the heartbeat's fallback (the coordinator did not answer) or
        # a restarted coordinator's: nothing is known of who is back, so the same holders are
        # looked at again, every one of them at its address.
        mark = fresh if fresh.holders else dataclasses.replace(mark, present=frozenset())


def _after_loss(state: Synced, lost: commits.Lost, mark: commits.Mark, why: str) -> int:
    """Rank 0 looks for a durable copy and tells everyone; all resume from it, or all raise.
    ``why`` says what became of the holders."""
    ctx = api.context()
    worker, cfg = ctx.worker, ctx.config
    found: tuple[Commit, object] | None = None
    news: tuple[Commit | None, str, tuple[commits.Holder, ...]] | None = None
    if worker.rank == 0:
        found, detail = _newest_durable(cfg.checkpoint_dir, cfg.checkpoint_keep)
        holders = mark.holders if mark.commit == lost.mark else ()
        news = (found[0] if found else None, detail, holders)
    shared = api.broadcast_object(news, root=0, name="ringserve.elastic.durable")
    assert isinstance(shared, tuple)
    durable, detail, holders = shared
    if not holders and mark.commit == lost.mark:
        holders = mark.holders
    named = [h.describe() for h in sorted(holders, key=lambda h: (h.view_id, h.rank))]
    resume = commits.after_loss(lost, durable)
    if resume is None:
        error = StateLostError(step=lost.mark.step, holders=named, view=worker.view_id, best=lost.best.step,
                               detail=f"{why}; {detail}")
        log.error("%s: %s", worker.tag, error)
        raise error
    died = f"every worker holding {lost.mark} died ({'; '.join(named) or 'workers the coordinator no longer knows'})"
    if resume.durable:
        source = f"the checkpoint of {resume.commit} in {cfg.checkpoint_dir}"
        if found is not None:
            state.load_snapshot(found[1])
            state.commits = resume.commit.step
            state.restore()
    else:
        source = f"{resume.commit}, the furthest a member holds (rank {resume.root}; the newest checkpoint is {durable})"
    log.warning("%s: %s (%s); resuming from %s", worker.tag, died, why, source)
    state.lineage = resume.lineage
    return resume.root


def _newest_durable(location: str, keep: int) -> tuple[tuple[Commit, object] | None, str]:
    """Rank 0's newest readable checkpoint, unpickled, or None and why there is none.

    Unpickled here, before the others hear of it: a copy that fails to load must make every
    rank fail alike, not leave the others waiting in a broadcast from rank 0.
    """
    if not location:
        return None, "no durable copy: RINGSERVE_CHECKPOINT_DIR (WorkerConfig.checkpoint_dir) is not set"
    found = store(location, keep).newest()
    if found is None:
        return None, f"no checkpoint could be read in {location}"
    commit, data, path = found
    try:
        return (commit, pickle.loads(data)), ""
    except Exception as exc:
        return None, f"the checkpoint {path} could not be unpickled ({type(exc).__name__}: {exc})"


def store(location: str, keep: int) -> CheckpointStore | CoordinatorStore:
    """The checkpoint store a location names; ``coordinator://`` goes through this worker."""
    if location != COORDINATOR:
        return CheckpointStore(location, keep)
    ctx = api.context()

    def get(key: str) -> bytes | None:
        try:
            return ctx.call(lambda w: w.get_params(key))
        except RingserveError as exc:  # NOT_FOUND (nothing written yet) or unreachable: no copy here
            log.warning("%s: no checkpoint from the coordinator's parameter store: %s", ctx.worker.tag, exc)
            return None

    return CoordinatorStore(put=lambda key, data: ctx.call(lambda w: w.put_params(key, data)), get=get)
