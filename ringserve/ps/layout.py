"""Which shard holds which bytes: a model's tensors cut into pieces, S shards of about equal bytes.

Pure: no sockets, no loop. Every worker computes the same layout from the same tensors (names,
shapes and dtypes, in the model's order) and the same S, and each shard is told its own part
at Init, which it checks.

The cut: lay the tensors end to end in one byte space of ``total`` bytes, and give shard ``i``
the bytes ``[i * total / S, (i + 1) * total / S)``, each boundary moved to the end of the element
that holds it. A tensor that crosses a boundary is split into pieces, one per shard it spans.
So every shard holds ``total / S`` bytes to within one element of the largest dtype, and there
are at most ``tensors + S - 1`` pieces: a whole-tensor assignment could not balance a model
whose largest tensor holds more than 1/S of the bytes (an MLP's 2048x2048 weight), and cutting
every tensor S ways would multiply the messages of a model of many small tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ringserve.errors import InvalidArgumentError

FLOAT_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor the parameter server holds: its shape and float dtype, and the optimizer
    group (an index into the job's optimizer groups) it steps with."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    group: int = 0

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of the flattened tensor ``spec.key``; (key, start) names it."""

    spec: TensorSpec
    start: int
    count: int

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def id(self) -> tuple[str, int]:
        return (self.spec.key, self.start)

    @property
    def stop(self) -> int:
        return self.start + self.count

    @property
    def nbytes(self) -> int:
        return self.count * self.spec.itemsize

    def describe(self) -> str:
        return f"{self.key!r}[{self.start}:{self.stop}] of shape {list(self.spec.shape)} {self.spec.dtype}"


@dataclass(frozen=True)
class Layout:
    """The pieces of each of S shards, in the tensors' order."""

    tensors: tuple[TensorSpec, ...]
    shards: tuple[tuple[Piece, ...], ...]

    def shard_bytes(self) -> list[int]:
        return [sum(p.nbytes for p in pieces) for pieces in self.shards]

    def pieces_of(self, key: str) -> list[tuple[int, Piece]]:
        """The (shard, piece) pairs that together hold the tensor ``key``, by start."""
        return [(i, p) for i, pieces in enumerate(self.shards) for p in pieces if p.key == key]


def check_spec(spec: TensorSpec) -> None:
    """Raises InvalidArgumentError naming a key, shape or dtype that the parameter server cannot hold."""
    if not spec.key:
        raise InvalidArgumentError("A tensor for the parameter server needs a non-empty key.")
    if spec.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"The tensor {spec.key!r} has dtype {spec.dtype}; the parameter server holds {', '.join(FLOAT_DTYPES)}."
        )
    if any(d < 0 for d in spec.shape):
        raise InvalidArgumentError(f"The tensor {spec.key!r} has a negative dimension in its shape {list(spec.shape)}.")
    if spec.group < 0:
        raise InvalidArgumentError(f"The tensor {spec.key!r} has optimizer group {spec.group}; groups start at 0.")


def specs_of(tensors: Iterable[tuple[str, np.ndarray]], groups: dict[str, int] | None = None) -> list[TensorSpec]:
    """The specs of named arrays, in their order (``groups``: each key's optimizer group, default 0)."""
    specs = []
    for key, array in tensors:
        spec = TensorSpec(key, tuple(int(d) for d in np.shape(array)), np.asarray(array).dtype.name,
                          (groups or {}).get(key, 0))
        check_spec(spec)
        specs.append(spec)
    return specs


def partition(tensors: Sequence[TensorSpec], shards: int) -> Layout:
    """Cuts the tensors into pieces over ``shards`` shards of about equal bytes (see the module).

    Empty tensors get no piece. Raises InvalidArgumentError for a repeated key, a bad spec, or
    shards below 1.
    """
    if shards < 1:
        raise InvalidArgumentError(f"The number of shards ({shards}) must be at least 1.")
    seen: set[str] = set()
    for spec in tensors:
        check_spec(spec)
        if spec.key in seen:
            raise InvalidArgumentError(f"The key {spec.key!r} is given twice; each tensor needs its own key.")
        seen.add(spec.key)
    total = sum(s.nbytes for s in tensors)
    bounds = [total * i // shards for i in range(shards + 1)]
    out: list[list[Piece]] = [[] for _ in range(shards)]
    offset = 0  # bytes before this tensor
    for spec in tensors:
        if spec.count == 0:
            continue
        size = spec.itemsize
        element = 0
        while element < spec.count:
            at = offset + element * size  # the byte this piece starts at
            shard = _shard_of(bounds, at)
            # The piece runs to the element that holds the next boundary (or the tensor's end).
            stop = spec.count if shard == shards - 1 else min(spec.count, -(-(bounds[shard + 1] - offset) // size))
            stop = max(stop, element + 1)
            out[shard].append(Piece(spec, element, stop - element))
            element = stop
        offset += spec.nbytes
    return Layout(tuple(tensors), tuple(tuple(p) for p in out))


def _shard_of(bounds: Sequence[int], at: int) -> int:
    """The shard whose byte range holds byte ``at`` (the last one for the end)."""
    shards = len(bounds) - 1
    for i in range(shards):
        if at < bounds[i + 1]:
            return i
    return shards - 1
