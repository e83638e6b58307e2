"""A parameter-server job as a shard holds it, shared by the shards and their clients.

``Job``: the pieces one shard holds, the mode, its staleness bound and the optimizer groups, each
checked as it is made (a bad Init is refused by name before anything is allocated). The client
builds one per shard from its layout (client/aio.py) and sends it in the Init; the shard keeps
it (shard/store.py) and writes it in its checkpoints (shard/checkpoint.py). Pure: no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve._proto import ps_pb2 as pb
from ringserve.errors import InvalidArgumentError
from ringserve.ps import optim
from ringserve.ps.layout import Piece, TensorSpec, check_spec
from ringserve.ps.rules import check_mode

PieceId = tuple[str, int]


@dataclass(frozen=True)
class Job:
    """What a shard holds for one job: its pieces, the mode and the optimizer groups."""

    mode: str
    staleness: int
    sum: bool
    groups: tuple[optim.Optimizer, ...]
    pieces: tuple[Piece, ...]
    shard: int
    shards: int
    max_lag: int = 0

    def __post_init__(self) -> None:
        check_mode(self.mode, self.staleness)
        if not self.groups:
            raise InvalidArgumentError("A job needs at least one optimizer group.")
        if not 0 <= self.shard < self.shards:
            raise InvalidArgumentError(f"The job's shard index {self.shard} must be in [0, {self.shards}).")
        seen: set[PieceId] = set()
        for piece in self.pieces:
            check_spec(piece.spec)
            if piece.id in seen:
                raise InvalidArgumentError(f"The job lists the piece {piece.describe()} twice.")
            seen.add(piece.id)
            if piece.count < 1 or piece.stop > piece.spec.count:
                raise InvalidArgumentError(f"The piece {piece.describe()} lies outside its tensor.")
            if piece.spec.group >= len(self.groups):
                raise InvalidArgumentError(
                    f"The tensor {piece.key!r} steps with optimizer group {piece.spec.group}, but the job has "
                    f"{len(self.groups)} groups."
                )

    @classmethod
    def from_proto(cls, job: pb.JobSpec) -> Job:
        """Raises InvalidArgumentError naming what is wrong with the spec."""
        groups = tuple(
            optim.Optimizer(kind=g.kind, lr=g.lr, momentum=g.momentum, dampening=g.dampening, nesterov=g.nesterov,
                            weight_decay=g.weight_decay, beta1=g.beta1, beta2=g.beta2, eps=g.eps)
            for g in job.groups
        )
        pieces = tuple(
            Piece(TensorSpec(p.key, tuple(int(d) for d in p.shape), p.dtype, p.group), int(p.start), int(p.count))
            for p in job.pieces
        )
        return cls(mode=job.mode, staleness=job.staleness, sum=job.sum, groups=groups, pieces=pieces,
                   shard=job.shard, shards=job.shards, max_lag=job.max_lag)

    def to_proto(self) -> pb.JobSpec:
        return pb.JobSpec(
            mode=self.mode, staleness=self.staleness, sum=self.sum, shard=self.shard, shards=self.shards,
            max_lag=self.max_lag,
            groups=[pb.OptimizerSpec(kind=g.kind, lr=g.lr, momentum=g.momentum, dampening=g.dampening,
                                     nesterov=g.nesterov, weight_decay=g.weight_decay, beta1=g.beta1,
                                     beta2=g.beta2, eps=g.eps) for g in self.groups],
            pieces=[piece_proto(p) for p in self.pieces],
        )

    def difference(self, other: Job) -> str:
        """A sentence naming how ``other`` differs from this job ("" when they agree)."""
        for name in ("shard", "shards", "mode", "staleness", "sum", "max_lag"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"the shard holds {name} {mine!r}, the Init asks for {theirs!r}"
        if self.groups != other.groups:
            return f"the shard's optimizer groups are {list(self.groups)}, the Init's {list(other.groups)}"
        if self.pieces != other.pieces:
            mine_ids, theirs_ids = [p.describe() for p in self.pieces], [p.describe() for p in other.pieces]
            first = next((a for a, b in zip(mine_ids, theirs_ids, strict=False) if a != b), None)
            return (f"the shard holds {len(mine_ids)} pieces, the Init names {len(theirs_ids)}"
                    + (f"; the first to differ is {first}" if first else ""))
        return ""


def piece_proto(piece: Piece) -> pb.PieceSpec:
    return pb.PieceSpec(key=piece.key, shape=list(piece.spec.shape), dtype=piece.spec.dtype,
                        start=piece.start, count=piece.count, group=piece.spec.group)
