"""Trees: allreduce over a double binary tree, and broadcast down a binary tree, pipelined.

Programs in the sense of programs.py, over the trees of topology.py.

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

A program is one sequence of steps, so a node interleaves the two directions: it takes chunk i
going up in both trees, then chunk i - lag coming down, with ``lag`` = 2 x depth + 1 chunks (the
pipeline's length), so it forwards chunks down while later ones still go up. It never waits for a
chunk to come down before it has sent everything that chunk needs on its way up, so no order of
arrival can deadlock it.

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


def tree_allreduce(ring: Ring, total: int, chunk_elems: int) -> Program:
    """Allreduce of ``total`` elements over the double binary tree of the ring's positions."""
    n, me = ring.size, ring.index
    parts = [chunk_bounds(a, b, chunk_elems) for a, b in halves(total)]
    if n == 1:
        for chunks in parts:
            for c, (a, b) in enumerate(chunks):
                yield Own(NO_SEND, c, a, b, alone=True)
        return
    links = [topology.tree_links(n, me, tree=t) for t in (0, 1)]
    down, notice = 2 * n, 2 * n + 2
    lag = 2 * topology.tree_depth(n) + 1
    longest = max(len(chunks) for chunks in parts)
    for t, (_, children) in enumerate(links):
        if children:
            yield Signal(notice + t, to=children)
    yield Phase("reduce")
    for i in range(longest + lag):
        for t, chunks in enumerate(parts):
            if i >= len(chunks):
                continue
            a, b = chunks[i]
            parent, children = links[t]
            up = t * n + me
            if not children:
                yield Lead(up, i, a, b, to=(parent,))
                continue
            for k, child in enumerate(children):
                yield Recv(t * n + child, i, frm=child)
                if k + 1 < len(children):
                    yield Fold(NO_SEND, i, a, b)
                elif parent >= 0:
                    yield Fold(up, i, a, b, to=(parent,))
                else:
                    yield Own(down + t, i, a, b, to=children)
        j = i - lag
        if j == 0:
            yield Phase("broadcast")
        for t, chunks in enumerate(parts):
            parent, children = links[t]
            if 0 <= j < len(chunks) and parent >= 0:
                a, b = chunks[j]
                yield Recv(down + t, j, frm=parent)
                yield Take(a, b)
                if children:
                    yield Forward(to=children)
    for t, (parent, _) in enumerate(links):
        if parent >= 0:
            yield Recv(notice + t, 0, frm=parent)


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
