"""Values for programs that reduce an element more than once on one rank: pure numpy, no I/O.

In a ring each rank reduces each element once: what arrives, with its own input. In
halving-doubling a rank reduces the half it keeps at every step, a tree node reduces what each of
its children sends, and a 2D ring reduces a segment along its row and then along its column. So a
reduction here combines what arrives with this rank's *partial* result for those elements when it
holds one (a ``Fold`` with slot NO_SEND keeps one), and with its input otherwise.

Two rules keep every rank bit-identical, as the ring's rule does (docs/design/algorithms.md, "Consistency, codecs, aborts, elastic views"):

- every partial result is computed by one rank and sent on, never computed twice, except in
  recursive doubling, where both partners compute the same sum of two group results; so
- the two operands of every reduction are ordered by the positions they come from in the ring
  (the earlier one's first), never by who computes it: ``a + b`` and ``b + a`` are the same bytes in IEEE
  arithmetic, but min and max of +0.0 and -0.0, and sums with two NaNs, are not.

Under a codec (``PartialCoded``) partial results travel encoded and are kept in float32 (float64
for float64) between reductions. Error feedback works as in the ring (values.Coded): in
halving-doubling, trees and 2D rings each element is encoded by each rank exactly once (when it
leaves that rank as a partial result, or as the finished result its owner sends), so what that one
encoding lost goes into ``residual``, in units of the sum, and the next call adds it back. The
owner keeps ``decode(encode(result))``, the very values the others decode. (Recursive doubling
would encode one group's sum once per member, so it does not run under a codec: see
worker/ops/algorithms.py.)
"""

from __future__ import annotations

import numpy as np

from ringserve.codecs import Codec
from ringserve.ring import combine_into
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.programs import Ring
from ringserve.worker.dataplane.values import Coded, Raw, payload_of

Range = tuple[int, int]


class Order:
    """Whether a frame's sender comes before this rank in the ring (its operand goes first)."""

    def __init__(self, ring: Ring) -> None:
        self.index = ring.index
        members = ring.members
        # The whole view's ring is in rank order; a sub-ring's may not be.
        self._positions = None if members == tuple(range(len(members))) else {m: i for i, m in enumerate(members)}

    def theirs_first(self, frame: Received) -> bool:
        sender = frame.header.sender_rank
        return (sender if self._positions is None else self._positions[sender]) < self.index


class PartialRaw(Raw):
    """Raw values (values.Raw) whose elements may be reduced several times on this rank, in the
    program over ``ring``. ``buf`` holds a range's partial result once it was reduced here.
    """

    def __init__(self, src: np.ndarray, buf: np.ndarray, op: str, world: int, *, ring: Ring, key: str = "") -> None:
        super().__init__(src, buf, op, world, key)
        self.order = Order(ring)
        self._held: set[Range] = set()

    def reduce(self, a: int, b: int, frame: Received) -> np.ndarray:
        """The reduction of what arrived with this rank's partial result (or input) for [a, b)."""
        part = self.buf[a:b]
        mine = part if (a, b) in self._held else self.src[a:b]
        self._held.add((a, b))
        theirs = payload_of(frame, self.buf.dtype, b - a, self.key)
        if self.order.theirs_first(frame):
            combine_into(theirs, mine, self.op, out=part)
        else:
            combine_into(mine, theirs, self.op, out=part)
        return part

    def pass_on(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        return part

    def first(self, a: int, b: int) -> np.ndarray:
        """What this rank sends of [a, b) before it has reduced any of it: its input."""
        return self.src[a:b]


class PartialCoded(Coded):
    """Coded values (values.Coded) whose elements may be reduced several times on this rank; the
    partial results wait here in the sum's dtype, unencoded, between reductions."""

    def __init__(self, src: np.ndarray, buf: np.ndarray, op: str, world: int, *, ring: Ring, key: str,
                 codec: Codec, residual: np.ndarray | None) -> None:
        super().__init__(src, buf, op, world, key, codec, residual)
        self.order = Order(ring)
        self._held: dict[Range, np.ndarray] = {}

    def reduce(self, a: int, b: int, frame: Received) -> np.ndarray:
        mine = self._held.get((a, b))
        if mine is None:
            mine = self._mine(a, b)
        theirs = self._decoded(frame, b - a)
        part = np.empty_like(mine)
        if self.order.theirs_first(frame):
            combine_into(theirs, mine, self.op, out=part)
        else:
            combine_into(mine, theirs, self.op, out=part)
        self._held[(a, b)] = part
        return part

    def pass_on(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        self._held.pop((a, b), None)
        return super().pass_on(a, b, part)

    def own(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        self._held.pop((a, b), None)
        return super().own(a, b, part)
