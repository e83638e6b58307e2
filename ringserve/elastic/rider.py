"""A commit's check, carried by the next step's gradient allreduce instead of an allreduce of its own.

At each commit the ranks must agree whether some rank saw workers waiting to join or wants to
leave (``state._flags``), and learn that every rank saved the commit. A small allreduce of the
flags does both, but on a step of a few tens of milliseconds its fixed cost is most of what a
commit costs (about 3 ms of a 24 ms step on the MLP of issue 45, three workers on two cores).

So a commit publishes its flags here (``publish``) and a gradient allreduce over the whole world
that starts afterwards carries them: the ``DistributedOptimizer`` appends ``SLOTS`` values to
each bucket, after the bucket's presence flags (zeros when nothing rides), and hands each reduced
bucket's values back (``Ride.carried``). The next commit then finds the answer in, and no
allreduce of its own ran. What makes this the same check:

- every rank publishes at the same point of the same program, so a bucket that one rank starts
  after its commit, every rank starts after its own: such a bucket holds every rank's flags, and
  each rank reads the same answer from it;
- such a bucket finishes only once every rank has entered the step after the commit, that is,
  once every rank has saved the commit;
- a flag is 0 or 1 and every reduction the buckets use (a sum or an average, scaled by a positive
  factor, with or without a codec that keeps 0 and 1) keeps "some rank sent 1" as "above 0".

A ride that no allreduce carried before the next commit (no optimizer step between two commits)
falls back to the allreduce of its own, then, on every rank alike. Only a state whose optimizer
can carry it publishes a ride (``State.rides``); the others start the allreduce at the commit, as
before. Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

SLOTS = 2  # the flags: some rank saw workers waiting to join; some rank wants to leave
HEAL = 1  # after them: 1 from a rank whose state is still on its way (a healing step, below)


class Ride:
    """One commit's flags, waiting for an allreduce to carry them, and the answer once one did."""

    def __init__(self, flags: np.ndarray, on_answer: Callable[[], None]) -> None:
        self.flags = (np.asarray(flags) > 0).astype(np.float64)[:SLOTS]
        self.answer: np.ndarray | None = None
        self._on_answer = on_answer  # called once, with the first answer (to start the commit's report)

    def carried(self, reduced: Sequence[float]) -> None:
        """An allreduce that started after the commit came back with ``reduced``, the sum or
        average of every rank's flags."""
        got = np.asarray(reduced, dtype=np.float64)[:SLOTS] > 0
        first = self.answer is None
        self.answer = got if self.answer is None else (self.answer | got)
        if first:
            self._on_answer()


class _Slot:
    """The ride that allreduces starting now carry (one per process: one elastic state runs at a
    time), the state this rank waits for while it heals, and what waits for its next step."""

    ride: Ride | None = None
    heal: Callable[[], None] | None = None
    after_step: ClassVar[list[Callable[[], None]]] = []


def publish(ride: Ride) -> None:
    """Makes ``ride`` the one that the next allreduces carry."""
    _Slot.ride = ride


def withdraw() -> None:
    """No allreduce carries anything from now on (the ride was answered, or dropped)."""
    _Slot.ride = None


def current() -> Ride | None:
    """The ride that an allreduce starting now carries, if any."""
    return _Slot.ride


# -- healing steps ---------------------------------------------------------------------------------
#
# A joiner whose state comes point to point (TorchState's handoff) need not stand still for it,
# nor make the members wait for it: as torchft's recovering replicas do, it takes part in its
# first step's gradient allreduce with zeros (and presence flags 0) while the state is on its way,
# and says so in the HEAL slot. Every rank then divides the sum by the ranks that contributed,
# not by the world's size, so the step is the members' average; the joiner loads the state
# once the allreduce is back (``heal``, from the optimizer's synchronize, or at the latest at its
# next commit) and applies that same average to it. The members' step costs them nothing more.


def begin_heal(finish: Callable[[], None]) -> None:
    """This rank heals: ``finish`` waits for its state and loads it."""
    _Slot.heal = finish


def healing() -> bool:
    """Whether this rank's state is still on its way (its allreduces send zeros and HEAL 1)."""
    return _Slot.heal is not None


def heal() -> None:
    """Loads the state this rank waits for, if any (once)."""
    finish, _Slot.heal = _Slot.heal, None
    if finish is not None:
        finish()


def drop_heal() -> None:
    """Forgets the state this rank waited for (a failure came first; the next sync sends it again),
    and what waited for its next step (the sends' owner lets them go itself)."""
    _Slot.heal = None
    _Slot.after_step = []


# A root that sends a healing joiner its tensors sends them once its own healing step's reductions
# are in (``after_step``, run by the optimizer's synchronize: ``stepped``), not into that step,
# whose allreduce they would slow on both ends; the joiner needs them only once that allreduce is
# back. The root's next commit, or the end of ``run``, lets them go at the latest.


def after_step(release: Callable[[], None]) -> None:
    """Runs ``release`` once this rank's next optimizer step has its reductions (``stepped``)."""
    _Slot.after_step.append(release)


def stepped() -> None:
    """This rank's optimizer step has its reductions: runs what waited for it (once)."""
    waiting, _Slot.after_step = _Slot.after_step, []
    for release in waiting:
        release()

