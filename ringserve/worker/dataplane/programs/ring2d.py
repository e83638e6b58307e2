"""The 2D ring: rings along the rows of a grid of positions, then along its columns.

A program in the sense of programs/__init__.py. The ring's n positions form an R x C grid (topology.grid,
rows of C consecutive positions). The vector is cut into C segments, one per column, and each
segment into R tiles, one per row. Three phases, as hierarchy.py's stages, but in one program with
one key, so that each tile flows on as soon as it is ready:

1. a ring reduce-scatter along each row: the position in column c ends with segment c reduced
   over its row (kept unencoded, as a partial result: partials.py);
2. a ring allreduce of segment c along each column: a reduce-scatter of its tiles, after which
   row r's position owns tile r fully reduced, then an allgather of the tiles;
3. a ring allgather of the segments along each row. Each finished tile goes on along the row as
   soon as it is known, forwarded byte for byte.

Each rank sends 2(C-1)/C + 2(R-1)/(RC) of the vector (about 2, as in a ring) in 2(C-1) + 2(R-1)
steps, about 4 sqrt(n), instead of the ring's 2(n-1). Each tile is reduced once on each rank, in a
fixed order, and forwarded unchanged: every rank ends with the same bytes.

Frames: (row step, chunk) in the row's reduce-scatter, (C + column step, chunk) in the column's,
and (C + R + segment * R + tile, chunk) for a finished tile, wherever it travels.
"""

from __future__ import annotations

from ringserve import topology
from ringserve.ring import allgather_step, chunk_bounds, reduce_scatter_step, segment_bounds
from ringserve.worker.dataplane.programs import (
    NO_SEND,
    Bounds,
    Fold,
    Forward,
    Lead,
    Own,
    Phase,
    Program,
    Recv,
    Ring,
    Take,
)


def tiles(total: int, rows: int, cols: int) -> list[list[Bounds]]:
    """``tiles[segment][tile]``: the C segments of ``total`` elements, each cut into R tiles."""
    return [[(a + x, a + y) for x, y in segment_bounds(b - a, rows)] for a, b in segment_bounds(total, cols)]


def ring2d_allreduce(ring: Ring, total: int, chunk_elems: int) -> Program:
    """Allreduce of ``total`` elements over the grid of the ring's positions (rows >= 2)."""
    n, me = ring.size, ring.index
    rows, cols = topology.grid(n)
    if rows < 2:
        raise ValueError(f"A 2D ring needs a grid of at least two rows; {n} ranks make {rows} x {cols}.")
    r, c = divmod(me, cols)
    row_next, row_prev = r * cols + (c + 1) % cols, r * cols + (c - 1) % cols
    col_next, col_prev = ((r + 1) % rows) * cols + c, ((r - 1) % rows) * cols + c
    grid = tiles(total, rows, cols)
    col_base, tile_base = cols, cols + rows

    def chunks(segment: int, tile: int) -> list[tuple[int, Bounds]]:
        return list(enumerate(chunk_bounds(*grid[segment][tile], chunk_elems)))

    def segment_chunks(segment: int) -> list[tuple[int, Bounds]]:
        """A segment's chunks, tile by tile, numbered along the segment."""
        out: list[tuple[int, Bounds]] = []
        for tile in range(rows):
            out += [(len(out) + i, ab) for i, (_, ab) in enumerate(chunks(segment, tile))]
        return out

    # 1. The row's reduce-scatter (programs.ring_reduce's, addressed to the row's neighbours).
    yield Phase("row_reduce_scatter")
    for k, (a, b) in segment_chunks(reduce_scatter_step(c, cols, 0)[0]):
        yield Lead(0, k, a, b, to=(row_next,))
    for step in range(cols - 2):
        for k, (a, b) in segment_chunks(reduce_scatter_step(c, cols, step)[1]):
            yield Recv(step, k, frm=row_prev)
            yield Fold(step + 1, k, a, b, to=(row_next,))
    # The last row step brings segment c: the tile the column's first step sends goes on at once.
    first_tile = reduce_scatter_step(r, rows, 0)[0]
    k = 0
    for tile in range(rows):
        for i, (a, b) in chunks(c, tile):
            yield Recv(cols - 2, k, frm=row_prev)
            if tile == first_tile:
                yield Fold(col_base, i, a, b, to=(col_next,))
            else:
                yield Fold(NO_SEND, i, a, b)
            k += 1
    # 2. The column's allreduce of segment c: tiles keyed by their own chunk numbers from here.
    yield Phase("column_allreduce")
    for step in range(rows - 1):
        tile = reduce_scatter_step(r, rows, step)[1]
        for i, (a, b) in chunks(c, tile):
            yield Recv(col_base + step, i, frm=col_prev)
            if step < rows - 2:
                yield Fold(col_base + step + 1, i, a, b, to=(col_next,))
            else:
                yield Own(tile_base + c * rows + tile, i, a, b, to=(col_next, row_next))
    for step in range(rows - 1):
        tile = allgather_step(r, rows, step)[1]
        for i, (a, b) in chunks(c, tile):
            yield Recv(tile_base + c * rows + tile, i, frm=col_prev)
            yield Take(a, b)
            yield Forward(to=(col_next, row_next) if step < rows - 2 else (row_next,))
    # 3. The row's allgather: every other segment, tile by tile, in the order its owner sent them.
    yield Phase("row_allgather")
    for step in range(cols - 1):
        segment = allgather_step(c, cols, step)[1]
        for tile in [r, *(allgather_step(r, rows, s)[1] for s in range(rows - 1))]:
            for i, (a, b) in chunks(segment, tile):
                yield Recv(tile_base + segment * rows + tile, i, frm=row_prev)
                yield Take(a, b)
                if step < cols - 2:
                    yield Forward(to=(row_next,))

