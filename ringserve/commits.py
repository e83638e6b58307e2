"""The job's committed high-water mark, and what an elastic sync does about it. Pure: no I/O.

Every synced worker reports, with its heartbeats, the commit its elastic state holds; the
coordinator keeps the furthest one reported and which workers held it (``record``). That mark
outlives the workers, so a view whose members all hold less knows that committed training was
lost: every worker that held the mark died before anyone else received it (a restarted process
holds only the initial state). ``plan_sync`` decides, from what each rank holds and the mark,
whose state the view takes; ``after_loss`` decides, once the state is lost, whether a durable
copy can replace it.

Commits are numbered within a *lineage*. A world that resumes from a durable copy goes back to
an older step, so it starts lineage ``mark.lineage + 1``: its commits rank above every commit of
the lost line (``Commit`` orders by lineage, then step), and stale reports of the old line can
never again make the mark look lost.

What a worker reports is a commit every member of its view holds: the one it synced to, or one
whose commit-time allreduce finished (every rank entered it after saving). A commit that only
one rank finished before the view broke is never reported, so the survivors redoing that step
is not mistaken for a loss.

A holder out of the view is not yet a holder gone. The coordinator declares a worker dead when
its heartbeats stop for a timeout, and a live one can miss it: stopped (SIGSTOP), or starved on a
loaded machine. Such a holder comes back (it rejoins under its id at its next heartbeat) with the
state. So before a loss is declared, ``judge_holders`` weighs what was seen of each holder: one
back with the coordinator is admitted and the view syncs again; one whose address refuses
connections is gone; one that answers, or stays silent, is waited for, up to a bound
(``WorkerConfig.holder_wait_s``). StateLostError (or a resume from a durable copy) comes only when
every holder is gone, or none came back within the bound.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Commit:
    """A commit's place in the job: its lineage, then its step (the number of commits)."""

    lineage: int
    step: int

    def __str__(self) -> str:
        return f"commit {self.step}" + (f" (lineage {self.lineage})" if self.lineage else "")


INITIAL = Commit(0, 0)  # what a fresh process holds: no commit yet


@dataclass(frozen=True)
class Holder:
    """A worker that reported holding a commit."""

    worker_id: str
    address: str
    view_id: int
    rank: int  # in view_id; -1 when unknown

    def describe(self) -> str:
        where = f"rank {self.rank} of view {self.view_id}" if self.rank >= 0 else f"a worker of view {self.view_id}"
        return f"{where}, worker {self.worker_id[:8]} at {self.address}"


@dataclass(frozen=True)
class Mark:
    """The furthest commit reported so far (None: none yet) and the workers that reported it.

    ``present``: in a worker's copy of the coordinator's answer, the holders the coordinator knew
    when it answered (members, or waiting to be admitted). The coordinator's own mark leaves it empty.
    """

    commit: Commit | None = None
    holders: tuple[Holder, ...] = ()
    present: frozenset[str] = frozenset()


# Holders named per commit, at most: the first to report it (a world of 2,000 names 32).
MAX_HOLDERS = 32


def record(mark: Mark, holder: Holder, held: Commit) -> Mark:
    """The mark after ``holder`` reports holding ``held``.

    A further commit replaces the mark and its holders; the same commit adds the holder (once per
    worker, with its latest view and rank); an older one changes nothing. Holders that died stay
    listed: naming them is the point.
    """
    if mark.commit is None or held > mark.commit:
        return Mark(held, (holder,))
    if held == mark.commit:
        others = tuple(h for h in mark.holders if h.worker_id != holder.worker_id)
        if len(others) >= MAX_HOLDERS:
            # Enough to name: a heartbeat must not cost work proportional to the world's size.
            return mark
        return Mark(held, (*others, holder))
    return mark


def record_view(mark: Mark, holders: Sequence[Holder], held: Commit) -> Mark:
    """The mark after the members of a view (``holders``, in rank order) are known to hold
    ``held``: a commit-time allreduce of that view finished, which every member entered after
    saving. Each is recorded as by ``record``, up to MAX_HOLDERS named in all."""
    if mark.commit is not None and held < mark.commit:
        return mark
    if mark.commit is None or held > mark.commit:
        return Mark(held, tuple(holders[:MAX_HOLDERS]))
    named = {h.worker_id for h in holders}
    others = tuple(h for h in mark.holders if h.worker_id not in named)
    return Mark(held, (*holders, *others)[:MAX_HOLDERS])


@dataclass(frozen=True)
class TakeRoot:
    """Every rank takes the state of ``root``, the lowest rank holding the furthest commit."""

    root: int


@dataclass(frozen=True)
class Lost:
    """No member holds the job's mark: the commits after ``best`` are gone with their holders."""

    mark: Commit
    best: Commit
    best_rank: int


@dataclass(frozen=True)
class Renew:
    """Every member that reported a commit holds less than it reported itself: each made a new elastic state (a second
    training in the same job, as a script may run one ``elastic.run`` after another). Nothing is
    lost: every rank takes ``root``'s state as the first commit of ``lineage``, above the mark."""

    root: int
    lineage: int


def plan_sync(held: Sequence[Commit], mark: Commit | None,
              renewed: Sequence[bool | None] = ()) -> TakeRoot | Lost | Renew:
    """Whose state a view takes, from what each rank holds (in rank order) and the job's mark.

    Args:
        held: each rank's commit; a fresh process holds INITIAL.
        mark: the furthest commit the job is known to have made (the ranks' agreed maximum of
            what the coordinator told them), or None if none is known.
        renewed: for each rank, whether it holds less than the commit it last reported itself,
            which only a new elastic state does (a restore never goes below a reported commit);
            None for a rank that reported nothing (a fresh process).

    Returns:
        TakeRoot when some member holds at least the mark (or no mark is known); Renew when
        none does, some member renewed its state, and every member that reported a commit
        renewed (a fresh process beside them is a joiner of the new training); else Lost.
    """
    if not held:
        raise ValueError("A view has at least one rank.")
    best_rank = min(range(len(held)), key=lambda r: (_neg(held[r]), r))
    best = held[best_rank]
    if mark is None or best >= mark:
        return TakeRoot(best_rank)
    reported = [bool(r) for r in renewed if r is not None]
    if reported and all(reported):
        return Renew(root=best_rank, lineage=mark.lineage + 1)
    return Lost(mark=mark, best=best, best_rank=best_rank)


def _neg(c: Commit) -> tuple[int, int]:
    return (-c.lineage, -c.step)


@dataclass(frozen=True)
class Resume:
    """After a loss, the view resumes from ``commit``: rank 0's durable copy (``durable``) or the
    furthest state a member holds (rank ``root``), as the first commit of ``lineage``."""

    commit: Commit
    durable: bool
    root: int
    lineage: int


def after_loss(lost: Lost, durable: Commit | None) -> Resume | None:
    """What a view that lost the mark does, given the newest durable copy rank 0 found.

    Returns:
        Resume from the newer of the durable copy and the members' furthest state (a copy can be
        newer than the mark, which trails the commits by a heartbeat); None when there is no
        durable copy: the caller raises StateLostError on every rank.
    """
    if durable is None:
        return None
    lineage = lost.mark.lineage + 1
    if durable >= lost.best:
        return Resume(commit=durable, durable=True, root=0, lineage=lineage)
    return Resume(commit=lost.best, durable=False, root=lost.best_rank, lineage=lineage)


class Seen(enum.Enum):
    """What a sync that lost the mark found of one of the mark's holders."""

    BACK = "back with the coordinator"  # it rejoined: a request for admission brings it in
    ALIVE = "alive (its peer server answers)"  # it will rejoin at its next heartbeat
    SILENT = "silent (no answer)"  # stopped, starved, cut off, or its host is down
    GONE = "gone (nothing, or another worker, listens at its address)"


@dataclass(frozen=True)
class Readmit:
    """Holders are back: ask for the waiting workers to be admitted, and sync in that view."""

    holders: tuple[Holder, ...]


@dataclass(frozen=True)
class Await:
    """Holders may still come back: look again shortly."""

    holders: tuple[Holder, ...]


@dataclass(frozen=True)
class Gone:
    """Every holder is gone, or none came back within the bound: the commit is lost. ``why``
    says what was seen of each, for the error."""

    why: str


def judge_holders(seen: Sequence[tuple[Holder, Seen]], waited_s: float, bound_s: float) -> Readmit | Await | Gone:
    """Whether a view that holds less than the mark may declare it lost yet.

    Args:
        seen: each holder of the mark with what was found of it.
        waited_s: how long this loss has been waited on already (across syncs).
        bound_s: how long it may be waited on at most (``WorkerConfig.holder_wait_s``).

    Returns:
        Readmit when a holder is back with the coordinator (within the bound); Gone when every
        holder is gone, when none is named, or when the bound has passed; else Await.
    """
    if not seen:
        return Gone("the coordinator names no holder")
    within = waited_s < bound_s
    back = tuple(h for h, s in seen if s is Seen.BACK)
    if back and within:
        return Readmit(back)
    maybe = tuple(h for h, s in seen if s is not Seen.GONE)
    if maybe and within:
        return Await(maybe)
    described = "; ".join(f"worker {h.worker_id[:8]} at {h.address or '?'} {s.value}" for h, s in seen)
    if not maybe:
        return Gone(f"every holder is gone: {described}")
    return Gone(f"no holder came back within {bound_s:g} s (holder_wait_s): {described}")
