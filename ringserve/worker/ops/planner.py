"""The plan of one collective call, made once before anything runs: pure (no sockets, no loop).

``plan(call, ground, figures, chunk_bytes)`` takes

- the call (``Call``): the op, its elements and their size, its bytes on the wire, its codec;
- the ground it runs on (``Ground``): the ring's size, this rank's position, every rank's host,
  and the settings that choose (RINGSERVE_ALGORITHM, RINGSERVE_HIERARCHICAL, the simulator's scale);
- the link figures (selection.planned's: a class's, agreed by the ring's ranks; None where the
  setting needs none, ``Ground.needs_figures``);

and returns a ``Plan``: the algorithm, and each stage's ring, algorithm and chunk, in order. The
rest only carries it out: algorithms.py and hierarchy.py build each stage's program
(programs/) and the executor (programs/executor.py) runs it. Nothing downstream decides again,
so that the path of a collective is one descent, collectives.py to the programs.

Every rank of a ring makes the same plan without a word: the inputs are alike on all of them
(the figures are agreed per view and ring, see worker/dataplane/calibration.py), but for this rank's
position, which changes only the chunk of a by-host plan's stage across hosts (its slice of the
tensor), alike within each ring across hosts. A plan is remembered (``PLANS_KEPT``): a training
loop asks the same few questions every step.

The choices themselves are selection.py's cost model; by host (hierarchy.py's three stages) is
chosen here from the view's hosts (``chosen``), and its stage across hosts is planned by the whole
view's figures with the uplink shared by a host's ranks (selection.across_hosts), the figures by
which ``auto`` chose to run by host at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

from ringserve import selection
from ringserve.ring import segment_bounds
from ringserve.selection import LinkCosts
from ringserve.worker.dataplane import routes

VIEW, LOCAL, CROSS = "view", "local", "cross"  # the rings a stage runs over: the session's, or by host
MODES = ("auto", "1", "0")  # RINGSERVE_HIERARCHICAL
OPS = ("allreduce", "barrier", "reduce_scatter", "allgather", "broadcast")
Rings = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Call:
    """What the planner needs of one call.

    ``count`` and ``itemsize``: the elements (0 where not every rank knows them: an allgather's
    blocks, an object's broadcast); ``wire_bytes``: the bytes it moves, encoded ones under a codec
    (0 where not every rank knows them); ``codec``: the codec's name, "" for none.
    """

    op: str
    count: int = 0
    itemsize: int = 1
    wire_bytes: int = 0
    codec: str = ""

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


class Where(Protocol):
    """A rank's place in a ring (``policy.Place`` and ``Ground`` both are one)."""

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def hosts(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Ground:
    """The ring a call runs over, as the planner sees it: its size, this rank's position, every
    rank's host (empty: not known), and the settings (``algorithm``: RINGSERVE_ALGORITHM;
    ``hierarchical``: RINGSERVE_HIERARCHICAL, "0" on a sub-ring; ``scale``: each payload byte stands
    for this many, testing/netsim.py)."""

    size: int
    rank: int
    hosts: tuple[int, ...]
    algorithm: str = selection.RING
    hierarchical: str = "0"
    scale: int = 1

    @property
    def needs_figures(self) -> bool:
        """Whether a plan on this ground reads the link figures (the ring's setting reads none)."""
        return self.algorithm != selection.RING and self.size > 1

    @property
    def apart(self) -> bool:
        """Whether every rank is on a host of its own, as the view says."""
        return apart(self.hosts, self.size)


@dataclass(frozen=True)
class Stage:
    """One program of a plan: over which ring (VIEW, LOCAL or CROSS), by which algorithm (a
    selection name, ``host_doubling/<L>``, or a tree broadcast's), in chunks of ``chunk_elems``."""

    name: str
    ring: str
    algorithm: str
    chunk_elems: int


@dataclass(frozen=True)
class Plan:
    """What one call runs: ``algorithm`` (the whole call's: a flat one, or BY_HOST for three
    stages), its ``stages`` in order, its ``codec``, and, by host, the ``rings``: the ranks of this
    rank's host, and those at its local position on every host."""

    op: str
    algorithm: str
    stages: tuple[Stage, ...]
    codec: str = ""
    rings: Rings | None = None

    @property
    def by_host(self) -> bool:
        """Numbered and run as an allreduce by host (hierarchy.py): in stages, or as one program."""
        return self.rings is not None

    @property
    def stage(self) -> Stage:
        """The one stage of a plan of one."""
        (only,) = self.stages
        return only


BY_HOST = "by_host"
LOCAL_REDUCE, ACROSS, LOCAL_GATHER = "local-reduce", "cross", "local-gather"


def apart(hosts: tuple[int, ...], size: int) -> bool:
    """Whether each of ``size`` ranks on ``hosts`` is on a host of its own (and there are two or more)."""
    return len(hosts) == size > 1 and len(set(hosts)) == len(hosts)


@functools.lru_cache(maxsize=selection.PLANS_KEPT)
def plan(call: Call, ground: Ground, figures: LinkCosts | None, chunk_bytes: int) -> Plan:
    """The plan of ``call`` on ``ground`` by ``figures``, in chunks of about ``chunk_bytes``.

    Raises:
        ValueError: an unknown op, or a setting that is not one of selection.SETTINGS.
    """
    if call.op == "allreduce":
        return _allreduce(call, ground, figures, chunk_bytes)
    if call.op == "barrier":  # an allreduce of its one element, flat
        return flat(_choose("allreduce", ground, figures, call.wire_bytes, chunk_bytes), call, ground, chunk_bytes)
    if call.op not in OPS:
        raise ValueError(f"No plan for the op {call.op!r}: it is one of {', '.join(OPS)}.")
    algorithm = _choose(call.op, ground, figures, call.wire_bytes, chunk_bytes, coded=bool(call.codec))
    return flat(algorithm, call, ground, chunk_bytes)


def flat(algorithm: str, call: Call, ground: Ground, chunk_bytes: int) -> Plan:
    """The plan of ``call`` by ``algorithm`` over the whole ring, in one stage: what ``plan``
    chose, or what a rank that stands in for the others' call is told they run (join.py)."""
    chunk = _chunk_elems(call.op, algorithm, call, ground.size, ground.apart, chunk_bytes, ground.scale)
    return Plan(call.op, algorithm, (Stage("", VIEW, algorithm, chunk),), call.codec)


def _choose(op: str, ground: Ground, figures: LinkCosts | None, nbytes: int, chunk_bytes: int, *,
            coded: bool = False) -> str:
    if not ground.needs_figures:
        return selection.RING
    scale = ground.scale
    return selection.choose(ground.algorithm, op, nbytes * scale, ground.size, figures, chunk_bytes * scale,
                            coded=coded).algorithm


def _allreduce(call: Call, ground: Ground, figures: LinkCosts | None, chunk_bytes: int) -> Plan:
    rings = chosen(ground.hierarchical, ground) if not call.codec and ground.size > 1 else None
    if rings is None:
        return flat(_choose("allreduce", ground, figures, call.wire_bytes, chunk_bytes, coded=bool(call.codec)),
                    call, ground, chunk_bytes)
    local, hosts, scale = len(rings[0]), len(rings[1]), ground.scale
    if ground.algorithm == selection.AUTO and ground.hierarchical == "auto" and figures is not None and not (
            selection.by_host(call.nbytes * scale, local, hosts, figures, chunk_bytes * scale)):
        algorithm = selection.flat_plan(call.nbytes * scale, local, hosts, figures, chunk_bytes * scale).algorithm
        return flat(algorithm, call, ground, chunk_bytes)
    return _by_host(call, ground, figures, rings, chunk_bytes)


def _by_host(call: Call, ground: Ground, figures: LinkCosts | None, rings: Rings, chunk_bytes: int) -> Plan:
    """Three stages (a reduce-scatter within each host, an allreduce of each slice across hosts, an
    allgather within each host: hierarchy.py), or, where the stage across hosts runs recursive
    doubling and each host holds consecutive ranks, one program with the same hops in half the
    frames (programs/halving_doubling.host_doubling)."""
    local, hosts, scale = len(rings[0]), len(rings[1]), ground.scale
    across = selection.RING
    if ground.needs_figures and figures is not None:
        across = selection.across_hosts(ground.algorithm, call.nbytes * scale, local, hosts, figures,
                                        chunk_bytes * scale).algorithm
    plain = max(1, chunk_bytes // call.itemsize)
    if across == selection.RECURSIVE_DOUBLING and consecutive(ground):
        fused = routes.by_hosts_of(local)
        return Plan(call.op, fused, (Stage("", VIEW, fused, plain),), rings=rings)
    a, b = segment_bounds(call.count, local)[rings[0].index(ground.rank)]
    part = Call(call.op, b - a, call.itemsize, (b - a) * call.itemsize)
    cross = _chunk_elems(call.op, across, part, hosts, hosts > 1, chunk_bytes, scale)
    stages = (Stage(LOCAL_REDUCE, LOCAL, selection.RING, plain), Stage(ACROSS, CROSS, across, cross),
              Stage(LOCAL_GATHER, LOCAL, selection.RING, plain))
    return Plan(call.op, BY_HOST, stages, rings=rings)


def _chunk_elems(op: str, algorithm: str, call: Call, n: int, spread: bool, chunk_bytes: int, scale: int) -> int:
    """The chunk, in elements, of ``call`` by ``algorithm`` over ``n`` ranks: a ring allreduce's
    and reduce-scatter's wider between hosts (``spread``, selection.ring_chunk), a tree
    allreduce's its own (selection.tree_chunk, on the bytes on the wire), else ``chunk_bytes``."""
    itemsize = call.itemsize
    if op in ("allreduce", "reduce_scatter") and algorithm == selection.RING:
        return max(1, selection.ring_chunk(call.nbytes, n, chunk_bytes, apart=spread) // itemsize)
    if op in ("allreduce", "barrier") and algorithm == selection.TREE:
        tree = max(1, selection.tree_chunk(call.wire_bytes * scale, n, chunk_bytes * scale) // scale)
        return max(1, tree // itemsize)
    return max(1, chunk_bytes // itemsize)


# -- the rings by host -----------------------------------------------------------------------------


def topology(where: Where) -> Rings | None:
    """(the ranks of this rank's host, the ranks at its local position on every host), or None
    where the hosts of the ring hold different numbers of workers (or are not known)."""
    if len(where.hosts) != where.size:
        return None
    return _rings(where.hosts, where.rank)


@functools.lru_cache(maxsize=64)  # asked on every allreduce, the same answer for the view
def _rings(hosts: tuple[int, ...], rank: int) -> Rings | None:
    by_host: dict[int, list[int]] = {}
    for r, host in enumerate(hosts):
        by_host.setdefault(host, []).append(r)
    if len({len(ranks) for ranks in by_host.values()}) != 1:
        return None
    mine = by_host[hosts[rank]]
    position = mine.index(rank)
    return tuple(mine), tuple(by_host[h][position] for h in sorted(by_host))


def consecutive(where: Where) -> bool:
    """Whether each host holds consecutive ranks, as many on each (as the launchers number them):
    what programs/halving_doubling.host_doubling runs over."""
    return topology(where) is not None and _consecutive(where.hosts)


@functools.lru_cache(maxsize=64)  # asked on every allreduce by host, the same answer for the view
def _consecutive(hosts: tuple[int, ...]) -> bool:
    """Hosts of equal size (topology's check) holding consecutive ranks each."""
    local = hosts.count(hosts[0])
    return all(hosts[r] == hosts[r - r % local] for r in range(len(hosts))) and len(set(hosts)) == len(hosts) // local


def chosen(mode: str, where: Where) -> Rings | None:
    """The rings of an allreduce by host, or None for a flat one.

    ``auto``: with more than one host, several workers on each and as many on every host; ``1``:
    whenever every host holds as many workers (even one host, or one worker each); ``0``: never.
    """
    if mode == "0":
        return None
    rings = topology(where)
    if rings is None or mode == "1":
        return rings
    local, cross = rings
    return rings if len(local) > 1 and len(cross) > 1 else None
