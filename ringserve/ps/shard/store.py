"""A shard's job and values: what it holds, how a push is checked and decoded, and how it is applied.

No sockets and no loop: the servicer (service.py) feeds it bytes and carries out the ledger's
decisions (rules.py) on it. Two rules keep a shard's state safe from bad input and from readers:

- **Checked before touched.** A push names its pieces (key, shape, dtype, start, count) in its
  header; ``check_push`` refuses the first one that is not a piece of this shard, or whose shape or
  dtype differs, with an InvalidArgumentError naming it, before any byte is read. ``decode``
  refuses a payload of the wrong length or with NaN or Inf. Nothing is applied until the whole
  push has been read and decoded, so a refused push leaves the shard as it was.
- **New arrays, not writes.** An update makes each piece's values a new array (optim.py), so a
  pull that is still streaming the old arrays sends one consistent version, without a copy.
- **Computed, then installed.** An update is computed (``stepped``, ``round_stepped``: the
  optimizer's arithmetic, on a thread of the servicer's) without touching what pulls read, then
  installed at once (``install``: a reference a piece, on the loop), so a pull never sees some
  pieces of an update and not others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ringserve._proto import ps_pb2 as pb
from ringserve.codecs import Codec
from ringserve.errors import InvalidArgumentError
from ringserve.ps import optim
from ringserve.ps.jobs import Job, PieceId
from ringserve.ps.layout import Piece


@dataclass
class Entry:
    """One piece on its shard: its values, optimizer state and the version it last changed at."""

    piece: Piece
    values: np.ndarray
    state: optim.State
    changed: int = 0


class Store:
    """The values of one shard's pieces, and the sum of the round in progress (sync, average)."""

    def __init__(self, job: Job, values: Mapping[PieceId, np.ndarray], version: int = 0,
                 states: Mapping[PieceId, optim.State] | None = None) -> None:
        self.job = job
        self.entries: dict[PieceId, Entry] = {}
        for piece in job.pieces:
            array = values.get(piece.id)
            if array is None:
                raise InvalidArgumentError(f"No values were given for the piece {piece.describe()}.")
            self.entries[piece.id] = Entry(piece, np.asarray(array, dtype=piece.spec.dtype).reshape(-1),
                                           (states or {}).get(piece.id) or optim.State(), version)
        self.nbytes = sum(p.nbytes for p in job.pieces)
        self._round: dict[PieceId, np.ndarray] = {}
        self.round_pushes = 0
        self.round_lrs: list[float] = []

    # -- checking a push -------------------------------------------------------------------

    def check_push(self, specs: Sequence[pb.PieceSpec], codec: Codec | None, kind: int,
                   group_lrs: Sequence[float]) -> dict[PieceId, int]:
        """The pieces a push names, each with its payload's length in bytes.

        Raises:
            InvalidArgumentError: a key or piece this shard does not hold, a shape or dtype that
                differs from the piece's, a piece named twice, the wrong kind for the mode, or a
                learning rate per group of the wrong length or value.
        """
        job = self.job
        if kind == pb.DELTA and job.mode != "average":
            raise InvalidArgumentError(f"A push of deltas needs average mode; the job runs {job.mode} mode.")
        if kind == pb.GRADIENT and job.mode == "average":
            raise InvalidArgumentError("average mode takes deltas (local values minus the values pulled), not gradients.")
        if group_lrs and len(group_lrs) != len(job.groups):
            raise InvalidArgumentError(
                f"The push gives {len(group_lrs)} learning rates for the job's {len(job.groups)} optimizer groups."
            )
        for lr in group_lrs:
            if not (math.isfinite(lr) and lr >= 0):
                raise InvalidArgumentError(f"The push's learning rate {lr!r} must be finite and at least 0.")
        sizes: dict[PieceId, int] = {}
        for spec in specs:
            entry = self.entries.get((spec.key, spec.start))
            if entry is None:
                raise InvalidArgumentError(self._unknown(spec))
            piece = entry.piece
            shape = tuple(int(d) for d in spec.shape)
            if shape != piece.spec.shape:
                raise InvalidArgumentError(
                    f"The push's {spec.key!r} has shape {list(shape)}; shard {job.shard} holds it with shape "
                    f"{list(piece.spec.shape)}."
                )
            if spec.dtype != piece.spec.dtype:
                raise InvalidArgumentError(
                    f"The push's {spec.key!r} has dtype {spec.dtype or '(none)'}; shard {job.shard} holds it as "
                    f"{piece.spec.dtype}."
                )
            if spec.count != piece.count:
                raise InvalidArgumentError(
                    f"The push's piece {spec.key!r}[{spec.start}:{spec.start + spec.count}] does not match the "
                    f"shard's piece {piece.describe()}."
                )
            if piece.id in sizes:
                raise InvalidArgumentError(f"The push names the piece {piece.describe()} twice.")
            sizes[piece.id] = codec.encoded_bytes(piece.count) if codec is not None else piece.nbytes
        return sizes

    def _unknown(self, spec: pb.PieceSpec) -> str:
        keys = sorted({p.key for p in self.job.pieces})
        if spec.key not in keys:
            listed = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
            return (f"Shard {self.job.shard} of {self.job.shards} holds no piece of the key {spec.key!r}; "
                    f"its keys are {listed or '(none)'}.")
        starts = [p.start for p in self.job.pieces if p.key == spec.key]
        return (f"Shard {self.job.shard} holds the key {spec.key!r} from elements {starts}, not from "
                f"element {spec.start}.")

    def decode(self, pid: PieceId, data: bytes | bytearray | np.ndarray, codec: Codec | None) -> np.ndarray:
        """A push's payload of one piece as values (float32 after a codec, else the piece's dtype).

        Raises:
            InvalidArgumentError: NaN or Inf in it (it would poison every worker's model).
        """
        piece = self.entries[pid].piece
        if codec is None:
            values = np.frombuffer(data, dtype=piece.spec.dtype)
        else:
            values = codec.decode(data.data if isinstance(data, np.ndarray) else memoryview(data), piece.count)
        if not np.isfinite(values).all():
            raise InvalidArgumentError(f"The push's {piece.describe()} holds NaN or Inf; the shard refused it whole.")
        return values

    # -- applying --------------------------------------------------------------------------

    def _lr(self, piece: Piece, group_lrs: Sequence[float]) -> float | None:
        return group_lrs[piece.spec.group] if group_lrs else None

    def apply(self, grads: Mapping[PieceId, np.ndarray], version: int, group_lrs: Sequence[float] = (),
              *, scale: float = 1.0) -> None:
        """One optimizer step of each piece pushed, against ``scale * grad``; ``version`` is the
        shard's version after it."""
        self.install(self.stepped(grads, group_lrs, scale=scale), version)

    def stepped(self, grads: Mapping[PieceId, np.ndarray], group_lrs: Sequence[float] = (), *,
                scale: float = 1.0) -> dict[PieceId, np.ndarray]:
        """The new values of each piece pushed, one optimizer step against ``scale * grad``, not yet
        installed (the optimizer state steps). May run on a thread: one update at a time."""
        new: dict[PieceId, np.ndarray] = {}
        for pid, grad in grads.items():
            entry = self.entries[pid]
            g = grad if scale == 1.0 else grad * np.asarray(scale, dtype=grad.dtype)
            opt = self.job.groups[entry.piece.spec.group]
            new[pid] = optim.step(opt, entry.values, g, entry.state, self._lr(entry.piece, group_lrs))
        return new

    def install(self, new: Mapping[PieceId, np.ndarray], version: int) -> None:
        """Makes ``new`` the pieces' values as of ``version``: at once, on the loop."""
        for pid, values in new.items():
            entry = self.entries[pid]
            entry.values = values
            entry.changed = version

    def accumulate(self, grads: Mapping[PieceId, np.ndarray], group_lrs: Sequence[float]) -> None:
        """Adds a push to the round in progress (sync, average)."""
        for pid, grad in grads.items():
            total = self._round.get(pid)
            if total is None:
                work = np.float64 if self.entries[pid].values.dtype == np.float64 else np.float32
                self._round[pid] = grad.astype(work, copy=True)
            else:
                total += grad
        if not self.round_pushes:
            self.round_lrs = list(group_lrs)
        self.round_pushes += 1

    def finish_round(self, version: int) -> None:
        """Applies the round's mean (or sum) and starts the next; deltas (average mode) step as
        the gradient ``-delta``, so that SGD with lr 1 sets the values to the mean of the workers'."""
        self.install(self.round_stepped(), version)
        self.next_round()

    def round_stepped(self) -> dict[PieceId, np.ndarray]:
        """The new values the round in progress makes (``stepped`` of its mean or sum), not yet installed."""
        count = self.round_pushes
        scale = 1.0 if self.job.sum else 1.0 / max(count, 1)
        if self.job.mode == "average":
            scale = -scale
        return self.stepped(self._round, self.round_lrs, scale=scale)

    def next_round(self) -> None:
        """Starts the next round (after the last one's values were installed)."""
        self._round = {}
        self.round_pushes = 0
        self.round_lrs = []

    def changed_since(self, version: int | None) -> list[Entry]:
        """Every entry (None), or those changed after ``version``."""
        return [e for e in self.entries.values() if version is None or e.changed > version]


def decode_init(job: Job, chunks: Iterable[tuple[PieceId, bytes | bytearray | np.ndarray]]) -> dict[PieceId, np.ndarray]:
    """The raw values of every piece of a job, from its Init's joined payloads.

    Raises:
        InvalidArgumentError: a piece missing, unknown, of the wrong length, or not finite.
    """
    pieces = {p.id: p for p in job.pieces}
    values: dict[PieceId, np.ndarray] = {}
    for pid, data in chunks:
        piece = pieces.get(pid)
        if piece is None:
            raise InvalidArgumentError(f"The Init sends values for {pid[0]!r} from element {pid[1]}, not a piece of shard {job.shard}.")
        if len(data) != piece.nbytes:
            raise InvalidArgumentError(f"The Init sends {len(data)} bytes for {piece.describe()}, which takes {piece.nbytes}.")
        array = np.frombuffer(data, dtype=piece.spec.dtype)
        if not np.isfinite(array).all():
            raise InvalidArgumentError(f"The Init's values of {piece.describe()} hold NaN or Inf.")
        values[pid] = array
    missing = [p.describe() for p in job.pieces if p.id not in values]
    if missing:
        raise InvalidArgumentError(f"The Init sends no values for {missing[0]}" + (f" and {len(missing) - 1} more." if len(missing) > 1 else "."))
    return values
