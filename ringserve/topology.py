"""Who talks to whom in the data plane's programs that are not rings: pure functions of (position, size).

Three shapes, each a function of a ring's size and a position in it (never of the data), so that
every rank derives the same shape from its view, and the plane can check a frame's sender from its
key alone (routes.py):

- **Halving-doubling** (``fold``, ``partner``): the ``p`` positions of the largest power of two
  in ``n`` exchange with partners at distances p/2, p/4, ..., 1 (the reduce-scatter by halving)
  and back (the allgather by doubling); the ``r = n - p`` others fold in first, as MPICH does:
  among the first ``2r`` positions, each even one gives its whole vector to the odd one after it,
  which stands for both, and gets the result back at the end.
- **Binary trees** (``tree_parent``, ``tree_children``): the in-order binary tree over labels
  1..n (label ``x`` has the subtree of width ``lowbit(x)`` around it), with the labels above n cut
  off and their subtrees' remaining nodes hung on the nearest ancestor. Its root is the largest
  power of two in n, its depth at most log2(n), and every even position is a leaf (its label is
  odd). The second tree of a double binary tree is the first shifted by one position, so a
  position that is a leaf in one is inside the other (NCCL's construction): each position sends
  at most one tree's share of the data down to two children.
- **Grids** (``grid``): R x C positions, rows of C in position order, the shape closest to
  square; a 2D ring runs a ring along each row and along each column.
"""

from __future__ import annotations

from functools import lru_cache

# -- halving-doubling ----------------------------------------------------------------------------


def power_below(n: int) -> int:
    """The largest power of two that is at most ``n`` (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def fold(n: int, pos: int) -> tuple[int, int]:
    """(virtual rank among the power-of-two positions, the position folded with) of ``pos``.

    The virtual rank is -1 for a position that folds its data into its partner and waits for the
    result; the partner is -1 for a position that folds with nobody.
    """
    extra = n - power_below(n)
    if pos < 2 * extra:
        return (-1, pos + 1) if pos % 2 == 0 else (pos // 2, pos - 1)
    return pos - extra, -1


def position(n: int, vrank: int) -> int:
    """The position of virtual rank ``vrank`` (the inverse of ``fold``)."""
    extra = n - power_below(n)
    return 2 * vrank + 1 if vrank < extra else vrank + extra


def partner(n: int, vrank: int, distance: int) -> int:
    """The position a virtual rank exchanges with at ``distance`` (a power of two)."""
    return position(n, vrank ^ distance)


@lru_cache(maxsize=256)
def hd_peers(n: int, pos: int) -> frozenset[int]:
    """Every position that ``pos`` exchanges frames with in halving-doubling or recursive doubling."""
    vrank, folded = fold(n, pos)
    peers = {folded} if folded >= 0 else set()
    if vrank >= 0:
        p = power_below(n)
        peers.update(partner(n, vrank, 1 << s) for s in range(p.bit_length() - 1))
    return frozenset(peers)


# -- binary trees ----------------------------------------------------------------------------------


def _lowbit(x: int) -> int:
    return x & -x


def tree_parent(n: int, q: int) -> int:
    """The parent of tree position ``q`` (label q + 1) in the cut in-order tree of ``n``; -1 at
    the root."""
    x, root = q + 1, power_below(n)
    while x != root:
        low = _lowbit(x)
        x = x - low if x & (2 * low) else x + low
        if x <= n:
            return x - 1
    return -1


def tree_children(n: int, q: int) -> tuple[int, ...]:
    """The children of tree position ``q``, left first (at most two)."""
    x = q + 1
    low = _lowbit(x)
    if low == 1:
        return ()
    kids = [x - low // 2]
    y = x + low // 2
    while y > n and _lowbit(y) > 1:
        y -= _lowbit(y) // 2
    if y <= n:
        kids.append(y)
    return tuple(k - 1 for k in kids)


@lru_cache(maxsize=256)
def tree_depth(n: int) -> int:
    """The longest path from the root to a leaf, in hops."""
    return max((_depth(n, q) for q in range(n)), default=0)


def _depth(n: int, q: int) -> int:
    hops = 0
    while (q := tree_parent(n, q)) >= 0:
        hops += 1
    return hops


def dual_position(n: int, pos: int, tree: int) -> int:
    """Where ``pos`` sits in tree 0 or tree 1 of the double binary tree."""
    return pos if tree == 0 else (pos + 1) % n


def dual_member(n: int, q: int, tree: int) -> int:
    """The position that sits at ``q`` in tree ``tree`` (the inverse of ``dual_position``)."""
    return q if tree == 0 else (q - 1) % n


def rooted_position(n: int, pos: int, root: int) -> int:
    """Where ``pos`` sits in the single tree whose root is position ``root``."""
    return (pos - root + power_below(n) - 1) % n


def rooted_member(n: int, q: int, root: int) -> int:
    """The position at tree position ``q`` of the tree rooted at ``root``."""
    return (q + root - power_below(n) + 1) % n


def tree_links(n: int, pos: int, *, tree: int = 0, root: int = -1) -> tuple[int, tuple[int, ...]]:
    """(parent, children) of ``pos``, as positions: in tree ``tree`` of the double binary tree, or,
    with ``root`` >= 0, in the single tree rooted there. The parent is -1 at the root."""
    if root >= 0:
        q = rooted_position(n, pos, root)
        parent = tree_parent(n, q)
        return (rooted_member(n, parent, root) if parent >= 0 else -1,
                tuple(rooted_member(n, c, root) for c in tree_children(n, q)))
    q = dual_position(n, pos, tree)
    parent = tree_parent(n, q)
    return (dual_member(n, parent, tree) if parent >= 0 else -1,
            tuple(dual_member(n, c, tree) for c in tree_children(n, q)))


@lru_cache(maxsize=256)
def tree_peers(n: int, pos: int, root: int = -1) -> frozenset[int]:
    """Every position that ``pos`` exchanges frames with in the double binary tree (or in the
    single tree rooted at ``root``)."""
    peers: set[int] = set()
    for tree in (0,) if root >= 0 else (0, 1):
        parent, children = tree_links(n, pos, tree=tree, root=root)
        peers.update(children)
        if parent >= 0:
            peers.add(parent)
    peers.discard(pos)
    return frozenset(peers)


# -- grids -----------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def grid(n: int) -> tuple[int, int]:
    """(rows, columns) of the grid closest to square with rows <= columns; rows is 1 when ``n``
    is prime (then a 2D ring is a ring)."""
    rows = 1
    for r in range(1, int(n**0.5) + 1):
        if n % r == 0:
            rows = r
    return rows, n // rows


def grid_peers(n: int, pos: int) -> tuple[frozenset[int], frozenset[int]]:
    """(positions ``pos`` hears from, positions it sends to) in a 2D ring: its row's and its
    column's neighbours."""
    rows, cols = grid(n)
    r, c = divmod(pos, cols)
    before = {r * cols + (c - 1) % cols, ((r - 1) % rows) * cols + c}
    after = {r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c}
    before.discard(pos)
    after.discard(pos)
    return frozenset(before), frozenset(after)
