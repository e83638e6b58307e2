"""The coordinator as the directory of parameter-server shards: who holds index i of S, and where.

Pure and clock-injected, like membership.py; the service's RegisterShard and ListShards are thin
adapters over it. A shard registers once when its process starts (``first``) and again every
``refresh_s`` as its lease; a shard silent for ``lease_s`` no longer holds its index, and the next
shard to register without asking for another index takes it (a container restarted by its
policy, which remembers nothing). Rules, in order:

- A registration under the shard id that holds an index refreshes it; with ``first`` set it is a
  new process under a known id (``ringserve ps`` restarting its child), so the incarnation goes up
  and workers reconnect.
- A registration asking for index i takes it if it is free or its lease lapsed, and is refused
  while another shard holds it.
- A registration asking for any index takes the lowest free one, then the lowest lapsed one.
- Every registration must agree on S with the first one; S is fixed once a shard registered.

Each new holder of an index gets the next incarnation, so a worker that sees the incarnation
change knows the shard restarted (and may have restored an older version: see ringserve/ps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.errors import InvalidArgumentError, RingserveError

# The largest S a directory accepts: far above any real job, low enough that a bad request
# cannot make the coordinator allocate much.
MAX_SHARDS = 4096


class ShardIndexTakenError(RingserveError):
    """The index asked for is held by another shard whose lease has not lapsed."""


class NoFreeShardError(RingserveError):
    """Every index is held by a live shard: the job has S shards already."""


@dataclass
class Slot:
    """The shard that holds one index."""

    shard_id: str
    address: str
    seen_at: float
    incarnation: int


@dataclass
class Registered:
    """What a registration got: the index, and its incarnation."""

    index: int
    shards: int
    incarnation: int


@dataclass
class Directory:
    """Shards by index, with leases.

    Example:
        ```python
        d = Directory(lease_s=5.0)
        got = d.register("a1", "10.0.0.3:7000", shards=2, index=-1, first=True, now=0.0)
        d.entries(now=1.0)   # [(0, slot, alive)]
        ```
    """

    lease_s: float
    shards: int = 0
    slots: dict[int, Slot] = field(default_factory=dict)
    _incarnations: int = 0

    def register(self, shard_id: str, address: str, *, shards: int, index: int, first: bool, now: float) -> Registered:
        """Registers or refreshes a shard.

        Raises:
            InvalidArgumentError: no shard id or address, S out of range or not the job's, or an
                index outside [0, S).
            ShardIndexTakenError: the index asked for is held by another live shard.
            NoFreeShardError: any index was asked for, and all S are held by live shards.
        """
        if not shard_id or not address:
            raise InvalidArgumentError(
                f"A shard must register with its id and address (got id {shard_id!r}, address {address!r})."
            )
        if not 1 <= shards <= MAX_SHARDS:
            raise InvalidArgumentError(f"The number of shards ({shards}) must be in [1, {MAX_SHARDS}].")
        if self.shards and shards != self.shards:
            raise InvalidArgumentError(
                f"The shard {shard_id!r} at {address} registers as one of {shards} shards, but the job "
                f"has {self.shards} (the first shard to register set it)."
            )
        if not -1 <= index < shards:
            raise InvalidArgumentError(f"The shard index {index} must be in [0, {shards}) (or -1 for any).")
        self.shards = shards
        held = self._held_by(shard_id)
        if held is not None and index in (-1, held):
            slot = self.slots[held]
            if first or slot.address != address:
                slot.incarnation = self._next()
            slot.address, slot.seen_at = address, now
            return Registered(held, shards, slot.incarnation)
        if index >= 0:
            holder = self.slots.get(index)
            if holder is not None and self.alive(holder, now):
                raise ShardIndexTakenError(
                    f"Shard index {index} of {shards} is held by shard {holder.shard_id!r} at {holder.address}, "
                    f"whose lease lapses in {holder.seen_at + self.lease_s - now:.1f} s."
                )
            chosen = index
        else:
            chosen = self._free(now)
        if held is not None:
            del self.slots[held]  # one index per shard: it moved to another
        self.slots[chosen] = Slot(shard_id, address, now, self._next())
        return Registered(chosen, shards, self.slots[chosen].incarnation)

    def alive(self, slot: Slot, now: float) -> bool:
        return now - slot.seen_at < self.lease_s

    def entries(self, now: float) -> list[tuple[int, Slot, bool]]:
        """Every index ever registered, in order, with its holder and whether its lease holds."""
        return [(i, slot, self.alive(slot, now)) for i, slot in sorted(self.slots.items())]

    def _held_by(self, shard_id: str) -> int | None:
        for i, slot in self.slots.items():
            if slot.shard_id == shard_id:
                return i
        return None

    def _free(self, now: float) -> int:
        for i in range(self.shards):
            if i not in self.slots:
                return i
        for i in range(self.shards):
            if not self.alive(self.slots[i], now):
                return i
        raise NoFreeShardError(
            f"All {self.shards} shard indices are held by live shards; a shard that restarts gets its "
            f"index once the old one's lease ({self.lease_s:g} s) lapses."
        )

    def _next(self) -> int:
        self._incarnations += 1
        return self._incarnations
