"""What a program's steps do to the data: pure numpy, no I/O, one class per way values travel.

The executor turns each step of a program (programs/__init__.py) into one call here: ``Lead`` is
``first``, ``Fold`` is ``reduce`` then ``pass_on``, ``Own`` is ``reduce`` (or ``alone``) then
``own``, ``Take`` is ``take``, ``Give`` is ``block``, ``Place`` is ``place``. Every incoming
payload is checked against what the step expects (dtype, count, codec, length) before it is used.
"""

from __future__ import annotations

import numpy as np

from ringserve import codecs, wire
from ringserve._proto.peer_pb2 import CODEC_NONE
from ringserve.codecs import Codec
from ringserve.errors import ProtocolError
from ringserve.ring import combine_into, finish_into
from ringserve.worker.dataplane.inbox import Received

# Ranks cut a collective's payloads into chunks of their own chunk_bytes: a peer set otherwise sends
# frames of other sizes, which these checks are the first to see.
CHUNK_HINT = " (every worker must set the same RINGSERVE_CHUNK_BYTES)"


def payload_of(frame: Received, dtype: np.dtype, count: int, key: str) -> np.ndarray:
    """The frame's elements, after checking that its dtype, count and length are the expected ones."""
    header, payload = frame.header, frame.payload
    if header.dtype != wire.dtype_code(dtype) or header.count != count or payload.nbytes != count * dtype.itemsize:
        raise ProtocolError(
            f"A frame of collective {key!r} carries {header.count} elements of dtype code {header.dtype} "
            f"in {payload.nbytes} bytes, where {count} elements of {dtype} were expected{CHUNK_HINT}."
        )
    return np.frombuffer(payload, dtype=dtype)


class Values:
    """The data of one collective. A step a collective does not use is a program error."""

    dtype = 0  # the wire code of the values' dtype
    codec = CODEC_NONE
    key = ""

    def _wrong(self, step: str) -> ProtocolError:
        return ProtocolError(f"A program of collective {self.key!r} took a {step} step, which its data has not.")

    def first(self, a: int, b: int) -> np.ndarray:
        raise self._wrong("Lead")

    def alone(self, a: int, b: int) -> np.ndarray:
        raise self._wrong("Own")

    def reduce(self, a: int, b: int, frame: Received) -> np.ndarray:
        raise self._wrong("Fold or Own")

    def pass_on(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        raise self._wrong("Fold")

    def own(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        raise self._wrong("Own")

    def take(self, a: int, b: int, frame: Received) -> None:
        raise self._wrong("Take")

    def block(self, origin: int) -> np.ndarray:
        raise self._wrong("Give")

    def landing(self, a: int, b: int) -> np.ndarray | None:
        """Elements [a, b) as the memory a frame for them may be read straight into (programs/__init__.py's
        ``Land``), if they are stored as they travel; None if a frame must be decoded first."""
        return None

    def place(self, origin: int, a: int, b: int, total: int, frame: Received) -> None:
        raise self._wrong("Place")


class Raw(Values):
    """A reduction whose values travel as they are: sums land straight in ``buf`` (may be ``src``).

    Each rank adds its own input once, to the partial result that arrives from its predecessor,
    so ``buf`` needs no copy of ``src`` first: every segment of ``buf`` is written once, by a
    reduction or by the allgather.
    """

    def __init__(self, src: np.ndarray, buf: np.ndarray, op: str, world: int, key: str = "") -> None:
        self.src, self.buf, self.op, self.world, self.key = src, buf, op, world, key
        self.dtype = wire.dtype_code(buf.dtype)
        self.codec = CODEC_NONE

    def alone(self, a: int, b: int) -> np.ndarray:
        """The "partial sum" of a world of one: this rank's input."""
        part = self.buf[a:b]
        if self.buf is not self.src:
            part[:] = self.src[a:b]
        return part

    def first(self, a: int, b: int) -> np.ndarray:
        """What this rank sends of its own input at the first step."""
        return self.src[a:b]

    def reduce(self, a: int, b: int, frame: Received) -> np.ndarray:
        """The partial sum of what arrived and this rank's input."""
        part = self.buf[a:b]
        combine_into(self.src[a:b], payload_of(frame, self.buf.dtype, b - a, self.key), self.op, out=part)
        return part

    def pass_on(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        """What goes to the successor for a partial sum."""
        return part

    def own(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        """Finishes the segment this rank owns; returns what the allgather phase sends of it."""
        finish_into(part, self.op, self.world)
        return part

    def take(self, a: int, b: int, frame: Received) -> None:
        """Stores a finished segment that arrived in the allgather phase (unless it was read
        straight into its place: ``landing``)."""
        data, place = payload_of(frame, self.buf.dtype, b - a, self.key), self.buf[a:b]
        if data.ctypes.data != place.ctypes.data:
            place[:] = data

    def landing(self, a: int, b: int) -> np.ndarray | None:
        return self.buf[a:b]


class Coded(Raw):
    """Partial sums travel encoded by ``codec`` and are added in float32 (float64 for float64).

    With ``residual`` (error feedback), this rank's input is ``src + residual``, and on return
    ``residual`` holds what this rank's encodings lost, in units of the sum: every segment is
    encoded by this rank exactly once, so adding it to the next call's input loses nothing over
    time. The owner of a segment keeps ``decode(encode(result))``, the very values the others
    decode, so that every rank ends bit-identical.
    """

    def __init__(self, src: np.ndarray, buf: np.ndarray, op: str, world: int, key: str,
                 codec: Codec, residual: np.ndarray | None) -> None:
        super().__init__(src, buf, op, world, key)
        self.coder = codec
        self.codec = codec.code
        self.residual = residual
        self.acc = codecs.sum_dtype(buf.dtype)

    def _mine(self, a: int, b: int) -> np.ndarray:
        x = self.src[a:b].astype(self.acc)
        if self.residual is not None:
            x += self.residual[a:b]
        return x

    def alone(self, a: int, b: int) -> np.ndarray:
        return self._mine(a, b)

    def first(self, a: int, b: int) -> np.ndarray:
        return self.pass_on(a, b, self._mine(a, b))

    def reduce(self, a: int, b: int, frame: Received) -> np.ndarray:
        part = self._mine(a, b)
        combine_into(part, self._decoded(frame, b - a), self.op)
        return part

    def pass_on(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        data = self.coder.encode(part)
        if self.residual is not None:  # decoded only to learn what the encoding lost
            np.subtract(part, self.coder.decode(data, b - a), out=self.residual[a:b])
        return data

    def own(self, a: int, b: int, part: np.ndarray) -> np.ndarray:
        finish_into(part, self.op, self.world)
        data = self.coder.encode(part)
        kept = self.coder.decode(data, b - a)
        if self.residual is not None:
            lost = self.residual[a:b]
            np.subtract(part, kept, out=lost)
            if self.op == "average":
                lost *= self.world
        self.buf[a:b] = kept
        return data

    def take(self, a: int, b: int, frame: Received) -> None:
        self.buf[a:b] = self._decoded(frame, b - a)

    def landing(self, a: int, b: int) -> np.ndarray | None:
        return None  # frames travel encoded

    def _decoded(self, frame: Received, count: int) -> np.ndarray:
        header, payload = frame.header, frame.payload
        if (header.codec != self.codec or header.dtype != self.dtype or header.count != count
                or payload.nbytes != self.coder.encoded_bytes(count)):
            raise ProtocolError(
                f"A frame of collective {self.key!r} carries {header.count} elements of dtype code "
                f"{header.dtype} in codec {header.codec} ({payload.nbytes} bytes), where {count} "
                f"elements of {self.buf.dtype} in {self.coder.name} were expected{CHUNK_HINT}."
            )
        return self.coder.decode(payload, count)


class Blocks(Values):
    """One block per origin, each of its own size: what an allgather or a broadcast moves.

    ``blocks[o]`` is given (this rank's own block, a broadcast's root) or None until its first
    frame arrives. ``expect[o]``, if not None, is the size a block must have (a broadcast whose
    non-roots know the shape); ``row`` is the number of elements a block's size must be a multiple
    of (an allgather of rows).
    """

    def __init__(self, dtype: np.dtype, blocks: list[np.ndarray | None], *, row: int = 1,
                 expect: list[int | None] | None = None, key: str = "") -> None:
        self.np_dtype = np.dtype(dtype)
        self.dtype = wire.dtype_code(self.np_dtype)
        self.blocks = blocks
        self.row = max(row, 1)
        self.expect = expect
        self.key = key

    def block(self, origin: int) -> np.ndarray:
        block = self.blocks[origin]
        assert block is not None, "a program gives only blocks this rank holds"
        return block

    def place(self, origin: int, a: int, b: int, total: int, frame: Received) -> None:
        block = self.blocks[origin]
        if block is None or block.size != total:
            expected = self.expect[origin] if self.expect is not None else None
            if expected is not None and total != expected:
                raise ProtocolError(f"The root of {self.key!r} sent {total} elements, not {expected}.")
            if total % self.row:
                raise ProtocolError(
                    f"Collective {self.key!r} got a block of {total} elements from position {origin}, "
                    f"which is not a whole number of rows of {self.row}."
                )
            block = self.blocks[origin] = np.empty(total, dtype=self.np_dtype)
        block[a:b] = payload_of(frame, self.np_dtype, b - a, self.key)


class Exchange(Blocks):
    """An alltoall's data: the blocks this rank sends, by destination position (what ``Give``
    takes), and the blocks it receives, by origin (what ``Place`` fills, as in ``Blocks``)."""

    def __init__(self, dtype: np.dtype, outgoing: list[np.ndarray], *, row: int = 1, key: str = "") -> None:
        super().__init__(dtype, [None] * len(outgoing), row=row, key=key)
        self.outgoing = outgoing

    def block(self, origin: int) -> np.ndarray:
        return self.outgoing[origin]
