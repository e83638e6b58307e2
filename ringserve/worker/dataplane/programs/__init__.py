"""Collectives as programs: each one a pure schedule of steps, carried out by programs/executor.py.

A program is a generator with no I/O. It yields one step at a time: receive frame (slot, chunk)
from the predecessor, reduce the frame in hand into elements [a, b), place it into a block,
forward it unchanged, send part of this rank's data, or send an empty signal. The executor
carries each step out over the session's link and answers a ``Recv`` with the frame's
``origin_count``, which is how a program learns the size of a block it did not know (a broadcast
on a non-root, a rank's block in an allgather). Everything else, deadlines, aborts, mismatch
checks, codecs, checksums, timelines and backpressure, is the executor's, once for all programs.

A frame is keyed by (slot, chunk). A slot names what a frame carries (a ring step, a segment, an
origin), chosen so that a frame forwarded unchanged keeps its key from hop to hop.

Programs run over a ``Ring``: ranks in ring order and this rank's position among them. Segments,
slots and origins are positions, and every send goes to the ring's next member (``Ring.next``),
so the same program runs a sub-ring of a subset of the view's ranks (a process set): the session
it runs on (session.py) sends on the plane's link to ``Ring.next``, and takes its frames from the
stream of the ring's previous member. A point-to-point pattern routed around the ring (alltoall) is
a program too: ``Give`` a block for each destination, and ``Place`` or ``Forward`` what arrives,
by how far its origin is (``alltoall_ring``); a point-to-point message is a ``Give`` over a ring of
two, its sender and its receiver (``message``, run by worker/ops/p2p.py). The simulator (tests/ringsim.py) runs these very
programs, through the executor, over in-memory links.

Programs that are not rings (halving-doubling, trees, 2D rings: programs/halving_doubling.py, programs/trees.py,
programs/ring2d.py) address peers by position: a sending step's ``to`` names the positions it goes
to (empty: the ring's next member), and a ``Recv``'s ``frm`` the position it comes from (-1: the
ring's previous member). Which positions a program may hear from is a pure function of its
algorithm and its ring (peers.py), so a frame's sender is checked on arrival, as a ring's is.

A collective made of several programs run one after the other under one key (Adasum's exchange,
its rounds of dot products, its gather) gives each its own range of slots with ``shifted``.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import NamedTuple

from ringserve.ring import allgather_step, chunk_bounds, reduce_scatter_step

Bounds = tuple[int, int]

NO_SEND = -1  # an Own step whose result stays here (a reduce-scatter, a world of one)
CONFIRM_SLOT = 1 << 30  # slots of the confirmation lap: far above any ring step or origin


@dataclass(frozen=True)
class Ring:
    """The ranks a program runs over, in ring order, and this rank's position in ``members``."""

    members: tuple[int, ...]
    index: int

    @classmethod
    def whole(cls, rank: int, world: int) -> Ring:
        """Every rank of a view, in rank order."""
        return cls(tuple(range(world)), rank)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def next(self) -> int:
        """The rank this rank sends to."""
        return self.members[(self.index + 1) % len(self.members)]


# -- steps -------------------------------------------------------------------------------------------
# NamedTuples: a step is made per chunk on the hot path, and a tuple is the cheapest object to make.


class Recv(NamedTuple):
    """Wait for frame (slot, chunk) from the predecessor (or from position ``frm``); it becomes
    the frame in hand.

    The program is sent the frame's ``origin_count`` back.
    """

    slot: int
    chunk: int
    frm: int = -1  # the position it comes from; -1: the ring's previous one (routes.py checks senders)


class Lead(NamedTuple):
    """Send this rank's own contribution to elements [a, b) as frame (slot, chunk) (to the
    positions ``to``; empty: the ring's next one, as for every sending step)."""

    slot: int
    chunk: int
    a: int
    b: int
    to: tuple[int, ...] = ()


class Fold(NamedTuple):
    """Reduce the frame in hand with this rank's contribution to [a, b); send the partial result
    on as frame (slot, chunk), or, with ``slot`` NO_SEND, keep it here to be reduced again (a
    program that reduces an element more than once on one rank, see partials.py)."""

    slot: int
    chunk: int
    a: int
    b: int
    to: tuple[int, ...] = ()


class Own(NamedTuple):
    """Reduce the frame in hand with this rank's contribution to [a, b) (or, with ``alone``, take
    that contribution as it is) and finish it: this rank owns [a, b). Unless ``slot`` is NO_SEND,
    send the result on as frame (slot, chunk)."""

    slot: int
    chunk: int
    a: int
    b: int
    alone: bool = False
    to: tuple[int, ...] = ()


class Take(NamedTuple):
    """Store the finished elements of the frame in hand into [a, b)."""

    a: int
    b: int


class Land(NamedTuple):
    """The frames ``frames`` ((slot, chunk, a, b) each) may be read
    straight into elements [a, b) of the values (values.py's ``landing``) as they arrive: each
    is stored there whole and unchanged by a later ``Take``, and nothing reads or writes those
    elements from this step until its frame has arrived. A hint that spares a payload lane's
    copy (lanes/tcp/frames.py's ``Landings``): a collective runs the same without it."""

    frames: tuple[tuple[int, int, int, int], ...]


class Give(NamedTuple):
    """Send elements [a, b) of block ``origin`` (of ``total`` elements) as frame (slot, chunk)."""

    slot: int
    chunk: int
    origin: int
    a: int
    b: int
    total: int
    to: tuple[int, ...] = ()


class Place(NamedTuple):
    """Store the frame in hand as elements [a, b) of block ``origin``, a block of ``total``."""

    origin: int
    a: int
    b: int
    total: int


class Forward(NamedTuple):
    """Send the frame in hand on to the successor (or to the positions ``to``) unchanged: same
    key, same bytes. The frame stays in hand, so it may be forwarded again."""

    to: tuple[int, ...] = ()


class Signal(NamedTuple):
    """Send an empty frame (slot, 0): an acknowledgement, a commit, a confirmation."""

    slot: int
    to: tuple[int, ...] = ()


class Phase(NamedTuple):
    """A new phase of the collective starts here (the timeline's spans)."""

    name: str


Step = Recv | Lead | Fold | Own | Take | Give | Place | Forward | Signal | Phase | Land
Program = Generator[Step, int | None, None]
# What a collective's stage runs: one program, or several at once over the same frames and values
# (a pipelined tree's climb and descent, programs/trees.py), each in slots of its own.
Programs = Program | tuple[Program, ...]

FORWARD = Forward()


# -- the programs ------------------------------------------------------------------------------------


def ring_reduce(ring: Ring, bounds: list[Bounds], chunk_elems: int, *, gather: bool) -> Program:
    """Ring reduce-scatter, then (with ``gather``) ring allgather, of segments ``bounds``.

    Reduce-scatter frames are keyed by ring step; allgather frames by ``size - 1 + segment``, so
    that they can be forwarded byte for byte. Pipelined: chunk c of step s + 1 leaves as soon as
    chunk c of step s has arrived and been reduced. After the reduce-scatter, position p holds the
    full result of segment p. Each segment is reduced once per rank, in a fixed order, so every
    rank ends with the same bytes.
    """
    n, me = ring.size, ring.index
    if n == 1:
        for c, (a, b) in enumerate(chunk_bounds(*bounds[0], chunk_elems)):
            yield Own(NO_SEND, c, a, b, alone=True)
        return
    gather_slot = n - 1
    if gather:
        # Safe to land: the final values of a segment come back only after this rank's partial
        # sum of it has reached its successor, and the allgather is all that writes them.
        yield Land(_gathered(me, n, bounds, chunk_elems, gather_slot))
    send_seg, _ = reduce_scatter_step(me, n, 0)
    for c, (a, b) in enumerate(chunk_bounds(*bounds[send_seg], chunk_elems)):
        yield Lead(0, c, a, b)
    for step in range(n - 1):
        _, recv_seg = reduce_scatter_step(me, n, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            yield Recv(step, c)
            if step == 0 and c == 0:
                yield Phase("reduce_scatter")
            if step < n - 2:
                yield Fold(step + 1, c, a, b)
            else:
                yield Own(gather_slot + me if gather else NO_SEND, c, a, b)
    if not gather:
        return
    yield Phase("allgather")
    for step in range(n - 1):
        _, recv_seg = allgather_step(me, n, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            yield Recv(gather_slot + recv_seg, c)
            yield Take(a, b)
            if step < n - 2:
                yield FORWARD


def _gathered(me: int, n: int, bounds: list[Bounds], chunk_elems: int, base: int) -> tuple[tuple[int, int, int, int], ...]:
    """The frames a ring allgather receives, as ``Land`` names them: (slot, chunk, a, b)."""
    frames: list[tuple[int, int, int, int]] = []
    for step in range(n - 1):
        _, seg = allgather_step(me, n, step)
        frames.extend((base + seg, c, a, b) for c, (a, b) in enumerate(chunk_bounds(*bounds[seg], chunk_elems)))
    return tuple(frames)


def ring_gather(ring: Ring, bounds: list[Bounds], chunk_elems: int) -> Program:
    """Ring allgather of segments ``bounds`` of one buffer, position p holding segment p: the
    allgather phase of ``ring_reduce`` on its own (a hierarchical allreduce's last stage, after a
    reduce-scatter and a reduction of each segment elsewhere). Frames are keyed by segment and
    forwarded byte for byte."""
    n, me = ring.size, ring.index
    if n == 1:
        return
    yield Phase("allgather")
    yield Land(_gathered(me, n, bounds, chunk_elems, 0))
    for c, (a, b) in enumerate(chunk_bounds(*bounds[me], chunk_elems)):
        yield Lead(me, c, a, b)
    for step in range(n - 1):
        _, recv_seg = allgather_step(me, n, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            yield Recv(recv_seg, c)
            yield Take(a, b)
            if step < n - 2:
                yield FORWARD


def broadcast_chain(ring: Ring, root: int, total: int, chunk_elems: int) -> Program:
    """Pipelined chain broadcast of block ``root`` from position ``root``, in three laps.

    Data runs root -> root+1 -> ... -> root-1 (``total`` is only known at the root; the others
    learn it from the first frame). The last position then sends an empty frame back to the root,
    which closes the ring: the root learns that every rank got the data and whether the last
    rank's arguments matched its own. The root then sends an empty commit frame down the chain,
    and a non-root returns only once it has it: a rank whose arguments differ is caught downstream
    of the ranks before it, and they must fail too, not return the data.
    """
    n, me = ring.size, ring.index
    last = (me + 1) % n == root
    if me == root:
        yield Phase("broadcast")
        if n > 1:
            for c, (a, b) in enumerate(chunk_bounds(0, total, chunk_elems)):
                yield Give(0, c, root, a, b, total)
            yield Recv(1, 0)
            yield Signal(2)
        return
    size = yield Recv(0, 0)
    assert size is not None
    yield Phase("broadcast")
    for c, (a, b) in enumerate(chunk_bounds(0, size, chunk_elems)):
        if c:
            yield Recv(0, c)
        yield Place(root, a, b, size)
        if not last:
            yield FORWARD
    if last:
        yield Signal(1)
    yield Recv(2, 0)
    if not last:
        yield FORWARD


def allgather_blocks(ring: Ring, total: int, chunk_elems: int) -> Program:
    """Ring allgather of blocks whose sizes differ by position; this position's has ``total``.

    Frames are keyed by origin, and a block's size travels in each of its frames.
    """
    n, me = ring.size, ring.index
    if n == 1:
        return
    for c, (a, b) in enumerate(chunk_bounds(0, total, chunk_elems)):
        yield Give(me, c, me, a, b, total)
    for step in range(n - 1):
        _, origin = allgather_step(me, n, step)
        size = yield Recv(origin, 0)
        assert size is not None
        if step == 0:
            yield Phase("allgather")
        for c, (a, b) in enumerate(chunk_bounds(0, size, chunk_elems)):
            if c:
                yield Recv(origin, c)
            yield Place(origin, a, b, size)
            if step < n - 2:
                yield FORWARD


def confirm(ring: Ring, base: int = CONFIRM_SLOT) -> Program:
    """A lap of empty frames: each rank returns only once every other rank has finished.

    With checksums on, a rank that finds a damaged frame aborts the collective, but the other
    ranks may have finished it already (a damaged frame of the last allgather step reaches one
    rank only). So each rank sends an empty frame once it is done, and returns only when it has
    the frames of all the others: an abort reaches every rank before then, and all ranks agree.
    It costs size - 1 hops of latency, and only with checksums.
    """
    n, me = ring.size, ring.index
    if n == 1:
        return
    yield Signal(base + me)
    for step in range(n - 1):
        _, origin = allgather_step(me, n, step)
        yield Recv(base + origin, 0)
        if step < n - 2:
            yield FORWARD


def alltoall_ring(ring: Ring, sizes: list[int], chunk_elems: int) -> Program:
    """Alltoall routed around the ring: this position sends ``sizes[d]`` elements of block ``d`` to
    position ``d`` and receives one block from every other position (its size from the frames).

    The block from position ``o`` to position ``d`` is keyed ``o * size + d`` and travels
    ``(d - o) % size`` hops, forwarded byte for byte by the positions between: each rank gives its
    own blocks farthest destination first, then, origin by origin (one hop behind, two, ...),
    receives the blocks that reach or pass it in the order their origin gave them, places the one
    addressed to it and forwards the others. So every link carries its frames in the order the
    receiver takes them, and a forwarded block leaves as soon as its chunk has arrived. Every block
    is at least one frame (an empty block: one empty frame), so every receiver learns every size and
    checks its predecessor's arguments. A position's block to itself is the caller's to copy: it
    never travels.

    Cost: a block travels as many hops as its distance, so each link carries ``(size - 1) / 2`` of
    a rank's data on average, where links to every peer would carry each block once. The keys do
    not depend on the route: with a link to every peer, the same exchange is a ``Give`` of each
    block to its destination and a ``Recv`` of key ``o * size + me`` from each origin, and the
    values (values.Exchange) and the checks stay as they are.
    """
    n, me = ring.size, ring.index
    if n == 1:
        return
    for dist in range(n - 1, 0, -1):
        dest = (me + dist) % n
        for c, (a, b) in enumerate(chunk_bounds(0, sizes[dest], chunk_elems)):
            yield Give(me * n + dest, c, dest, a, b, sizes[dest])
    for behind in range(1, n):
        origin = (me - behind) % n
        for dist in range(n - 1, behind - 1, -1):
            slot = origin * n + (origin + dist) % n
            size = yield Recv(slot, 0)
            assert size is not None
            if behind == 1 and dist == n - 1:
                yield Phase("alltoall")
            for c, (a, b) in enumerate(chunk_bounds(0, size, chunk_elems)):
                if c:
                    yield Recv(slot, c)
                if dist == behind:
                    yield Place(origin, a, b, size)
                else:
                    yield FORWARD


def message(ring: Ring, total: int, chunk_elems: int) -> Program:
    """A point-to-point message over a ring of two, from position 0 to position 1 (a send and its
    recv): the sender gives its block of ``total`` elements chunk by chunk and is done once they
    are on the link (an eager send, as gloo's and MPI's for messages that fit their buffers); the
    receiver learns the size from the first frame and places the block. Frames are keyed
    ``(0, chunk)``; an empty message is one empty frame, which carries the sender's descriptor.
    """
    if ring.size != 2:
        raise ValueError(f"A message runs over a ring of two (sender, receiver), not {ring.members}.")
    if ring.index == 0:
        yield Phase("send")
        for c, (a, b) in enumerate(chunk_bounds(0, total, chunk_elems)):
            yield Give(0, c, 0, a, b, total)
        return
    size = yield Recv(0, 0)
    assert size is not None
    yield Phase("recv")
    for c, (a, b) in enumerate(chunk_bounds(0, size, chunk_elems)):
        if c:
            yield Recv(0, c)
        yield Place(0, a, b, size)


def shifted(program: Program, offset: int) -> Program:
    """``program`` with every slot moved up by ``offset`` (NO_SEND stays NO_SEND): a stage of a
    collective that runs several programs under one key, in slots of its own."""
    reply: int | None = None
    while True:
        try:
            step = program.send(reply)
        except StopIteration:
            return
        if isinstance(step, Recv | Lead | Fold | Give | Signal) or (isinstance(step, Own) and step.slot != NO_SEND):
            step = step._replace(slot=step.slot + offset)
        elif isinstance(step, Land):
            step = Land(tuple((slot + offset, chunk, a, b) for slot, chunk, a, b in step.frames))
        reply = yield step
