"""Trees: allreduce over a double binary tree, and broadcast down a binary tree, pipelined.

Programs in the sense of programs/__init__.py, over the trees of topology.py.

**Allreduce** (NCCL's double binary tree): the vector is cut in two halves, one per tree. Along
each tree, chunk by chunk, every node reduces what its children send with its own data and sends
the partial result to its parent; the root finishes the chunk and sends it down, and every node
takes it and forwards it, byte for byte, to its children. Each position is a leaf in one tree (it
sends its half up once) and inside the other at most (it sends that half up once and down twice),
so each rank sends about twice the vector, as in a ring, in 2 x depth hops (depth <= log2 n), not
2 (n - 1). Frames are keyed (tree * n + sender, chunk) going up (the two children of a node are
apart) and (2n + tree, chunk) coming down.

Every parent first sends its children an empty frame (``notice``, taken last): a leaf would
otherwise hear nothing of a collective before it has to send, and a rank that has joined
(join.py) learns of the others' collectives from their frames.

The climb and the descent of each tree are four programs that the executor runs at once over the
same frames (programs.Programs): a node forwards chunks down while later ones still climb, and
neither tree nor direction ever waits for another, so the pipeline runs at the links' bandwidth,
however many chunks its latency holds in flight. (In one program, a node inside one tree and a
leaf of the other would tie the trees together, and each chunk would wait a round trip.)

**Broadcast** from a root: the data goes down one binary tree rooted there (log2 n hops, not n - 1
as in the chain), chunk by chunk, forwarded byte for byte. Then, as the chain's three laps do
(programs.broadcast_chain), every node acknowledges up the tree once it and its children have all
the data (and agree on the arguments), and the root sends a commit down: no rank returns the data
before every rank has it, so a rank whose arguments differ fails them all.
"""

from __future__ import annotations

from ringserve import topology
from ringserve.ring import chunk_bounds
from ringserve.worker.dataplane.programs import (
    NO_SEND,
    Bounds,
    Fold,
    Forward,
    Give,
    Lead,
    Own,
    Phase,
    Place,
    Program,
    Recv,
    Ring,
    Signal,
    Take,
)


def halves(total: int) -> list[Bounds]:
    """The elements each tree of the double binary tree reduces: [0, h) and [h, total)."""
    half = (total + 1) // 2
    return [(0, half), (half, total)]


def tree_allreduce(ring: Ring, total: int, chunk_elems: int) -> tuple[Program, ...]:
    """Allreduce of ``total`` elements over the double binary tree of the ring's positions: the
    climb and the descent of each tree, four programs the executor runs at once."""
    n, me = ring.size, ring.index
    parts = [chunk_bounds(a, b, chunk_elems) for a, b in halves(total)]
    if n == 1:
        return (_alone(parts),)
    climbs = tuple(_climb(n, me, t, parts[t]) for t in (0, 1))
    return (*climbs, *(_descend(n, me, t, parts[t]) for t in (0, 1)))


def _alone(parts: list[list[Bounds]]) -> Program:
    for chunks in parts:
        for c, (a, b) in enumerate(chunks):
            yield Own(NO_SEND, c, a, b, alone=True)


def _climb(n: int, me: int, tree: int, chunks: list[Bounds]) -> Program:
    """Up one tree, chunk by chunk: reduce the children's partial results with this rank's data
    and send them to the parent; at the root, finish each chunk and send it down."""
    parent, children = topology.tree_links(n, me, tree=tree)
    up, down, notice = tree * n + me, 2 * n + tree, 2 * n + 2 + tree
    if children:
        yield Signal(notice, to=children)
    yield Phase("reduce")
    for i, (a, b) in enumerate(chunks):
        if not children:
            yield Lead(up, i, a, b, to=(parent,))
            continue
        for k, child in enumerate(children):
            yield Recv(tree * n + child, i, frm=child)
            if k + 1 < len(children):
                yield Fold(NO_SEND, i, a, b)
            elif parent >= 0:
                yield Fold(up, i, a, b, to=(parent,))
            else:
                yield Own(down, i, a, b, to=children)


def _descend(n: int, me: int, tree: int, chunks: list[Bounds]) -> Program:
    """Down one tree, chunk by chunk: take each finished chunk and forward it to the children."""
    parent, children = topology.tree_links(n, me, tree=tree)
    if parent < 0:
        return
    down, notice = 2 * n + tree, 2 * n + 2 + tree
    for i, (a, b) in enumerate(chunks):
        yield Recv(down, i, frm=parent)
        yield Take(a, b)
        if children:
            yield Forward(to=children)
    yield Recv(notice, 0, frm=parent)


def tree_broadcast(ring: Ring, root: int, total: int, chunk_elems: int) -> Program:
    """Broadcast of block ``root`` (``total`` elements, known at the root only) down the binary
    tree rooted at position ``root``; then acknowledgements up and a commit down.

    Frames: data (0, chunk); a node's acknowledgement (1 + its position, 0); the commit (n + 1, 0).
    """
    n, me = ring.size, ring.index
    if n == 1:
        return
    parent, children = topology.tree_links(n, me, root=root)
    commit = n + 1
    if parent < 0:
        yield Phase("broadcast")
        for c, (a, b) in enumerate(chunk_bounds(0, total, chunk_elems)):
            yield Give(0, c, root, a, b, total, to=children)
    else:
        size = yield Recv(0, 0, frm=parent)
        assert size is not None
        yield Phase("broadcast")
        for c, (a, b) in enumerate(chunk_bounds(0, size, chunk_elems)):
            if c:
                yield Recv(0, c, frm=parent)
            yield Place(root, a, b, size)
            if children:
                yield Forward(to=children)
    yield Phase("confirm")
    for child in children:
        yield Recv(1 + child, 0, frm=child)
    if parent >= 0:
        yield Signal(1 + me, to=(parent,))
        yield Recv(commit, 0, frm=parent)
        if children:
            yield Forward(to=children)
    else:
        yield Signal(commit, to=children)
