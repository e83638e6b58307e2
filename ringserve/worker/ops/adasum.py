"""Adasum: the adaptive summation of Maleki et al. ("Scaling Distributed Training with Adaptive
Summation", MLSys 2021), as Horovod's CPU path computes it.

Two gradients combine as ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``: their sum when they are
orthogonal, their average when they are parallel, and in between the sum less half of each one's
projection on the other (a coefficient stays 1 for a vector whose squared norm is below
sqrt(DBL_MIN), so a zero gradient leaves the other as it is). The ranks' gradients combine in a
fixed binary tree of adjacent pairs, (0, 1), (2, 3), ... first, then (01, 23), ..., so the world
must be a power of two: Horovod refuses any other size ("Running Adasum with non-power of 2 ranks
is not supported yet"), and so does this module (UnsupportedError, a NotImplementedError). Each
``part`` (a tensor of a fused buffer) gets its own coefficients, as Horovod computes them per
tensor of its fusion buffer.

How it communicates, as one collective (executor.run_stages) of 2 + log2(size) stages:

1. an alltoall (programs.alltoall_ring): rank r receives segment r of every rank's gradient, so
   that it holds every rank's values of the elements it will compute, and nothing else;
2. one round per level of the tree: for each pair of that level and each part, rank r computes
   the dot product and both squared norms over its segment (in float64), and a ring allreduce
   sums these 3 x pairs x parts numbers over the ranks; every rank then holds the same sums, so
   the same coefficients, and combines the pairs over its segment (in float64, rounded to the
   dtype at each level, as Horovod's scaled add is);
3. an allgather (programs.allgather_blocks) of the finished segments.

Why this shape and not Horovod's vector-halving distance-doubling: the latter sends each level to
a partner ``rank ^ level``, which needs a link to any peer, and sums its dot products over groups
that are process sets; over one ring, the alltoall brings every segment's values to its owner in
one exchange, and the rounds move only a few numbers each. Every element of the result is computed
by exactly one rank, from sums that the ring allreduce makes bit-identical, and the allgather
forwards bytes unchanged: every rank ends with the same bytes by construction, whatever its CPU.
The data moves ``(size - 1) / 2`` of the gradient per link for the ring-routed alltoall (a direct
alltoall would move ``(size - 1) / size``) plus ``(size - 1) / size`` for the allgather, against
``2 (size - 1) / size`` for a ring allreduce; with links to any peer the alltoall stage takes them
as they are (see programs.alltoall_ring).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ringserve.errors import InvalidArgumentError, UnsupportedError
from ringserve.ring import segment_bounds
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import Program, Ring, executor
from ringserve.worker.dataplane.programs.executor import ring_of
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Blocks, Exchange, Raw, Values
from ringserve.worker.ops.arguments import as_array, chunk_elems, result_buffer

STAGE_SLOTS = 1 << 25  # each stage's slots: above any alltoall key (origin * size + destination) up to 5792 ranks
_TINY = math.sqrt(sys.float_info.min)  # Horovod's threshold: a squared norm below it gets coefficient 1


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """x . y in numpy's own loop, not BLAS's: BLAS wakes its thread pool for every call, which on a
    busy host cost more than the products themselves (a 4-rank Adasum of 4 MiB: ~60 ms a rank)."""
    return float(np.einsum("i,i->", x, y))


def coefficients(dot: float, a_norm2: float, b_norm2: float) -> tuple[float, float]:
    """The weights of a and b in their Adasum, from a.b, |a|^2 and |b|^2."""
    a = 1.0 - dot / a_norm2 * 0.5 if a_norm2 >= _TINY else 1.0
    b = 1.0 - dot / b_norm2 * 0.5 if b_norm2 >= _TINY else 1.0
    return a, b


def check(dtype: np.dtype, world: int) -> None:
    """Raises what Horovod raises for an Adasum it cannot do."""
    if dtype.kind != "f":
        raise InvalidArgumentError(f"Adasum combines floating point gradients, not {dtype}.")
    if world & (world - 1):
        raise UnsupportedError(
            f"Running Adasum with non-power of 2 ranks is not supported (the world has {world} ranks), as in Horovod."
        )


def descriptor_of(dtype: np.dtype, shape: tuple[int, ...], parts: list[int]) -> Descriptor:
    """An Adasum's descriptor: an allreduce whose op is adasum, with the parts it combines apart."""
    return Descriptor("allreduce", dtype=dtype.name, shape=shape, op="adasum", parts=tuple(parts))


class _Run:
    """One rank's Adasum: the stages it runs (given one at a time), and its result afterwards."""

    def __init__(self, ring: Ring, flat: np.ndarray, parts: list[int], chunk_bytes: int) -> None:
        self.ring, self.flat, self.parts, self.chunk_bytes = ring, flat, parts, chunk_bytes
        self.gathered: Blocks | None = None

    def _stage(self, index: int, program: Program) -> Program:
        return programs.shifted(program, index * STAGE_SLOTS)

    def stages(self) -> Iterator[tuple[Program, Values]]:
        n, me, flat = self.ring.size, self.ring.index, self.flat
        segments = segment_bounds(flat.size, n)
        s0, s1 = segments[me]
        outgoing = [flat[a:b] for a, b in segments]
        exchange = Exchange(flat.dtype, outgoing)
        exchange.blocks[me] = outgoing[me]
        elems = chunk_elems(flat.dtype, self.chunk_bytes)
        yield self._stage(0, programs.alltoall_ring(self.ring, [b.size for b in outgoing], elems)), exchange
        # Every rank's values of this rank's segment, as copies this rank combines in place.
        vectors = [np.array(b if b is not None else flat[:0], copy=True) for b in exchange.blocks]
        edges = np.cumsum([0, *self.parts]).tolist()
        local = [(max(lo, s0) - s0, max(min(hi, s1), s0) - s0) for lo, hi in itertools.pairwise(edges)]
        level, stage = 1, 1
        while level < n:
            firsts = list(range(0, n, 2 * level))
            partial = np.zeros((len(firsts), len(local), 3))
            # The pairs in float64, kept from the dot products to the combination.
            wide = [(vectors[i].astype(np.float64), vectors[i + level].astype(np.float64)) for i in firsts]
            for k, (x, y) in enumerate(wide):
                for p, (lo, hi) in enumerate(local):
                    partial[k, p] = (_dot(x[lo:hi], y[lo:hi]), _dot(x[lo:hi], x[lo:hi]), _dot(y[lo:hi], y[lo:hi]))
            sums = np.empty(partial.size)
            rounds = programs.ring_reduce(self.ring, segment_bounds(sums.size, n), chunk_elems(sums.dtype, self.chunk_bytes),
                                          gather=True)
            yield self._stage(stage, rounds), Raw(partial.reshape(-1), sums, "sum", n)
            totals = sums.reshape(partial.shape)
            for k, (i, (x, y)) in enumerate(zip(firsts, wide, strict=True)):
                for p, (lo, hi) in enumerate(local):
                    ca, cb = coefficients(*(float(v) for v in totals[k, p]))
                    part, other = x[lo:hi], y[lo:hi]
                    part *= ca
                    other *= cb
                    part += other
                    vectors[i][lo:hi] = part  # rounded to the dtype at each level, as Horovod's scaled add
            del wide
            level, stage = level * 2, stage + 1
        blocks: list[np.ndarray | None] = [None] * n
        blocks[me] = vectors[0]
        self.gathered = Blocks(flat.dtype, blocks)
        yield self._stage(stage, programs.allgather_blocks(self.ring, s1 - s0, elems)), self.gathered

    def result(self) -> np.ndarray:
        assert self.gathered is not None
        return np.concatenate([b if b is not None else self.flat[:0] for b in self.gathered.blocks])


def _parts(size: int, parts: list[int] | None) -> list[int]:
    if parts is None:
        return [size]
    if any(p < 0 for p in parts) or sum(parts) != size:
        raise InvalidArgumentError(f"Adasum parts {parts} must be non-negative and sum to the array's {size} elements.")
    return list(parts)


async def allreduce(session: Session, a: Any, *, name: str | None, chunk_bytes: int, timeout_s: float,
                    out: np.ndarray | None = None, parts: list[int] | None = None) -> np.ndarray:
    """Adasum of every rank's ``a``; a new array, or ``out`` (which may be ``a``), on every rank.

    ``parts``: element counts of the tensors fused in ``a`` (each gets its own coefficients).

    Raises:
        InvalidArgumentError: an integer array, or parts that do not tile it.
        UnsupportedError: the world's size is not a power of two (as in Horovod).
    """
    array = as_array(a)
    world = session.place.size
    check(array.dtype, world)
    flat = np.ascontiguousarray(array).reshape(-1)
    split = _parts(flat.size, parts)
    buf = result_buffer(session, array, out)
    run = _Run(ring_of(session), flat, split, chunk_bytes)
    if world == 1:
        buf[:] = flat
    else:
        await executor.run_stages(session, name, descriptor_of(array.dtype, tuple(array.shape), split), timeout_s,
                                  run.stages())
        buf[:] = run.result()
    return buf.reshape(array.shape) if out is None else out


async def stand_in(session: Session, key: str, descriptor: Descriptor, zeros: np.ndarray, *, chunk_bytes: int,
                   timeout_s: float) -> None:
    """A joined rank's part in the others' Adasum ``key`` (join.py): zeros, which leave them as they are."""
    split = list(descriptor.parts) if descriptor.parts is not None else [zeros.size]
    run = _Run(ring_of(session), zeros.reshape(-1), split, chunk_bytes)
    await executor.run_stages(session, None, descriptor, timeout_s, run.stages(), key=key)
