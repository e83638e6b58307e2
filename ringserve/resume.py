"""The effects of an elastic sync's decision: ask the coordinator for the job's mark, agree on it
with one allgather, and, when the view lost every holder of the last commit, resume from a durable
copy or raise StateLostError on every rank. The decision itself is commits.py's, pure.

``State.sync`` (ringserve.elastic) calls ``agree_root`` before it takes the chosen rank's state.
"""

from __future__ import annotations

import logging
import pickle
from typing import TYPE_CHECKING

import numpy as np

from ringserve import api, commits
from ringserve.checkpoint import COORDINATOR, CheckpointStore, CoordinatorStore
from ringserve.commits import Commit
from ringserve.errors import RingserveError, StateLostError

if TYPE_CHECKING:
    from ringserve.elastic import State

log = logging.getLogger("ringserve.elastic")


def agree_root(state: State) -> int:
    """The rank whose state the view takes; every rank returns the same one.

    Each rank asks the coordinator for the job's mark (falling back on the last heartbeat's), and
    one allgather shares what every rank holds and heard: the decision then has the same inputs
    everywhere. After a loss, ``state`` holds the durable copy on rank 0 and a new lineage.

    Raises:
        StateLostError: no member holds the job's last commit and no durable copy exists.
    """
    ctx = api.context()
    mark = ctx.call(lambda w: w.commit_mark(), timeout_s=ctx.config.rpc_timeout_s + 10.0)
    m = mark.commit
    known = (m.lineage, m.step, 1) if m is not None else (0, 0, 0)
    row = np.array([state.lineage, state.commits, *known], dtype=np.int64)
    rows = api.allgather(row, name="ringserve.elastic.commits").reshape(-1, 5)
    held = [Commit(int(r[0]), int(r[1])) for r in rows]
    marks = [Commit(int(r[2]), int(r[3])) for r in rows if r[4]]
    plan = commits.plan_sync(held, max(marks) if marks else None)
    if isinstance(plan, commits.TakeRoot):
        return plan.root
    return _after_loss(state, plan, mark)


def _after_loss(state: State, lost: commits.Lost, mark: commits.Mark) -> int:
    """Rank 0 looks for a durable copy and tells everyone; all resume from it, or all raise."""
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
        error = StateLostError(step=lost.mark.step, holders=named, view=worker.view_id, best=lost.best.step, detail=detail)
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
    log.warning("%s: %s; resuming from %s", worker.tag, died, source)
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
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same: no usable copy
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
