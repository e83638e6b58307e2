"""Hosts and slots for ``ringserve run``, as horovodrun has them: pure parsing and decisions.

- ``-H host1:4,host2:4`` and a hostfile (``host1 slots=4`` per line) name the hosts and their slots;
- a host discovery script prints ``host:slots`` (or ``host``) per line, and is polled in elastic runs;
- ``assign_slots`` numbers the slots as Horovod does: hosts in order, each host's slots filled
  before the next host's (ranks 0-3 on host1, 4-7 on host2), ``local_rank`` within a host, and
  ``cross_rank`` among the hosts that have that local rank;
- ``Blacklist`` keeps a host whose workers failed out of the run, for a cooldown that doubles with
  each failure when ``--blacklist-cooldown-range`` is given, else for good (Horovod's behaviour);
- ``plan_slots`` decides which slots an elastic run should have workers in now.

Nothing here opens a socket or starts a process; the clock and the randomness are injected.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ringserve.errors import InvalidArgumentError

# Host names as DNS, ssh config aliases and user@host have them; IPv6 literals go in brackets.
_HOST = r"(?:[A-Za-z0-9_.@-]+|\[[0-9A-Fa-f:.%a-z]+\])"
_HOST_SLOTS = re.compile(rf"^({_HOST})(?::(\d+))?$")

COOLDOWN_LOWER_LIMIT_S = 1  # Horovod's bounds on --blacklist-cooldown-range
COOLDOWN_UPPER_LIMIT_S = 3600


@dataclass(frozen=True)
class HostSpec:
    """A host and the number of workers it may run."""

    name: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """One worker's place in a launch: its host, and the ranks horovodrun would give it."""

    host: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    size: int


def _host_slots(entry: str, default_slots: int, where: str) -> HostSpec:
    m = _HOST_SLOTS.match(entry.strip())
    if not m:
        raise InvalidArgumentError(
            f"The host {entry.strip()!r} in {where} must have the form name:slots (for example host1:4)."
        )
    slots = int(m.group(2)) if m.group(2) is not None else default_slots
    if slots < 1:
        raise InvalidArgumentError(f"The host {entry.strip()!r} in {where} must have at least one slot.")
    return HostSpec(m.group(1), slots)


def _no_repeats(hosts: list[HostSpec], where: str) -> list[HostSpec]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise InvalidArgumentError(f"The host {h.name!r} appears twice in {where}; give it once with all its slots.")
        seen.add(h.name)
    return hosts


def parse_host_list(text: str, default_slots: int = 1) -> list[HostSpec]:
    """Parses ``-H``: ``host1:4,host2:4`` (a host without ``:slots`` gets ``default_slots``)."""
    entries = [e for e in text.split(",") if e.strip()]
    if not entries:
        raise InvalidArgumentError(f"The host list {text!r} (-H) names no host.")
    where = f"-H {text!r}"
    return _no_repeats([_host_slots(e, default_slots, where) for e in entries], where)


def parse_hostfile(text: str, path: str = "the hostfile", default_slots: int = 1) -> list[HostSpec]:
    """Parses a hostfile: one host per line, ``host slots=4`` (Open MPI's and horovodrun's form);
    a host without ``slots=`` gets ``default_slots``; ``#`` starts a comment."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        slots = default_slots
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("slots", "max_slots") or not value.isdigit():
                raise InvalidArgumentError(
                    f"Line {number} of {path} ({raw.strip()!r}) must have the form 'host slots=N'."
                )
            if key == "slots":
                slots = int(value)
        hosts.append(_host_slots(f"{name}:{slots}", default_slots, f"line {number} of {path}"))
    if not hosts:
        raise InvalidArgumentError(f"{path} names no host.")
    return _no_repeats(hosts, path)


def parse_discovery_output(text: str, default_slots: int = 1) -> dict[str, int]:
    """Parses what a host discovery script printed: ``host:slots`` or ``host`` per line, in order.

    Blank lines are skipped (a script may print nothing while no host is ready); a host printed
    twice keeps its first place and its last slot count.
    """
    found: dict[str, int] = {}
    for line in text.splitlines():
        if line.strip():
            spec = _host_slots(line, default_slots, "the host discovery script's output")
            found[spec.name] = spec.slots
    return found


def assign_slots(hosts: Sequence[HostSpec], num_proc: int) -> list[Slot]:
    """The first ``num_proc`` slots of ``hosts``, numbered as horovodrun numbers them.

    Raises:
        InvalidArgumentError: the hosts have fewer than ``num_proc`` slots in all.
    """
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise InvalidArgumentError(
            f"-np {num_proc} asks for more processes than the hosts have slots ({total}: {listed})."
        )
    placed: list[tuple[str, int]] = []
    for h in hosts:
        for local in range(h.slots):
            if len(placed) == num_proc:
                break
            placed.append((h.name, local))
    local_sizes: dict[str, int] = {}
    for host, _ in placed:
        local_sizes[host] = local_sizes.get(host, 0) + 1
    # cross_rank: the host's index among the hosts that have a slot with this local rank.
    by_local: dict[int, list[str]] = {}
    for host, local in placed:
        by_local.setdefault(local, []).append(host)
    return [
        Slot(host=host, rank=rank, local_rank=local, local_size=local_sizes[host],
             cross_rank=by_local[local].index(host), cross_size=len(by_local[local]), size=len(placed))
        for rank, (host, local) in enumerate(placed)
    ]


@dataclass
class Blacklist:
    """Hosts kept out of a run because a worker of theirs failed.

    Without a cooldown range a host stays out for good (Horovod's default). With ``(low, high)``
    its n-th blacklisting keeps it out ``low * 2**(n-1)`` seconds plus a random fraction of
    ``low``, at most ``high``: 10, 20, 40 ... s for ``(10, 100)``, as ``--blacklist-cooldown-range``.
    """

    cooldown_range: tuple[int, int] | None = None
    rand: Callable[[], float] = random.random
    _until: dict[str, float] = field(default_factory=dict)
    _count: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            if low < COOLDOWN_LOWER_LIMIT_S or high > COOLDOWN_UPPER_LIMIT_S or low > high:
                raise InvalidArgumentError(
                    f"--blacklist-cooldown-range {low} {high} must satisfy "
                    f"{COOLDOWN_LOWER_LIMIT_S} <= min <= max <= {COOLDOWN_UPPER_LIMIT_S} (seconds)."
                )

    def add(self, host: str, now: float) -> float | None:
        """Blacklists ``host``; returns the seconds it stays out, or None for good."""
        if self.is_blacklisted(host, now):
            until = self._until[host]
            return None if until == float("inf") else until - now
        self._count[host] = self._count.get(host, 0) + 1
        if self.cooldown_range is None:
            self._until[host] = float("inf")
            return None
        low, high = self.cooldown_range
        delay: float = min(float(high), low * 2 ** (self._count[host] - 1) + self.rand() * low)
        self._until[host] = now + delay
        return delay

    def is_blacklisted(self, host: str, now: float) -> bool:
        return self._until.get(host, 0.0) > now

    def times(self, host: str) -> int:
        """How many times ``host`` was blacklisted."""
        return self._count.get(host, 0)


def host_order(previous: Sequence[str], available: Iterable[str]) -> list[str]:
    """Hosts in assignment order: those already in the run keep their places (older hosts get the
    lower ranks, so the state is synced from them), new ones follow in the order given."""
    available = list(available)
    known = [h for h in previous if h in available]
    return known + [h for h in available if h not in known]


def plan_slots(order: Sequence[str], slots: Mapping[str, int], max_np: int,
               excluded: Callable[[str], bool]) -> list[tuple[str, int]]:
    """The (host, local index) pairs an elastic run should have workers in: the hosts in
    ``order`` that are not ``excluded`` (blacklisted), each host's slots in turn, at most
    ``max_np`` in all."""
    wanted: list[tuple[str, int]] = []
    for host in order:
        if excluded(host):
            continue
        for local in range(slots.get(host, 0)):
            if len(wanted) == max_np:
                return wanted
            wanted.append((host, local))
    return wanted
