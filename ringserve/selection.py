"""Which algorithm a collective runs: a cost model and a choice, pure (no sockets, no loop).

The model is the alpha-beta-gamma model of the literature (Thakur, Rabenseifner and Gropp, 2005):
a message of ``m`` bytes between two ranks costs ``alpha + m * beta`` seconds, each frame costs a
fixed ``frame_s`` of software on top (the executor's, the codec's, the link's), and each byte a
rank reduces costs ``gamma`` (``reduce_s``: the add, and, off shared memory, reading the received
bytes out of a buffer of their own). Each rank sends on one link at a time, so the bytes a rank
sends add up. For an allreduce of ``S`` bytes over
``n`` ranks (``p`` the largest power of two in n, ``D`` the depth of the trees, R x C the grid):

=====================  ===========================================  =====================================  ===================
algorithm              latency                                      bytes each rank sends                  bytes it reduces
=====================  ===========================================  =====================================  ===================
ring                   2 (n - 1) alpha (hidden behind large steps)  2 (n - 1) / n S                        (n - 1) / n S
halving_doubling       2 log2(p) alpha (+ 2 alpha to fold)          2 (p - 1) / p S (+ 2 S to fold)        (p - 1) / p S (+ S)
recursive_doubling     log2(p) alpha (+ 2 alpha to fold)            log2(p) S (+ 2 S to fold)              log2(p) S (+ S)
tree (double binary)   2 D alpha, plus the pipeline's fill          about 2 S, in chunks                   about S
ring2d                 2 (C - 1 + R - 1) alpha                      2 (C - 1) / C S + 2 (R - 1) / (R C) S  (n - 1) / n S
=====================  ===========================================  =====================================  ===================

``choose`` predicts each algorithm that can run the call and takes the fastest: recursive doubling
for small vectors (fewest steps), halving-doubling for power-of-two worlds once the vector is
larger, the tree for large vectors in worlds that are not powers of two (the fold costs 2 S), the
ring where latency does not matter. It is a function of the call (op, bytes, codec), the ring's
size and the link figures only, all equal on every rank of a ring (the figures are agreed per
view, see worker/dataplane/calibration.py), so every rank picks the same algorithm without a word.
Figures measured at start-up enter by their class only (``planned``: the host layout first, then
LAN or WAN by a threshold no run-to-run noise crosses), so the same job on the same machines plans
alike, and sums in the same order, from one run to the next.
Under a codec, recursive doubling is left out: it would encode each group's sum once per member,
where error feedback (worker/dataplane/partials.py) needs each element encoded once per rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ringserve.topology import grid, power_below, tree_depth

RING = "ring"
HALVING_DOUBLING = "halving_doubling"
RECURSIVE_DOUBLING = "recursive_doubling"
TREE = "tree"
RING2D = "ring2d"
# Recursive doubling by host as one program (programs_hd.host_doubling): where auto runs an allreduce
# by host with recursive doubling across hosts, over hosts of consecutive ranks (worker/ops/hierarchy.py).
HOST_DOUBLING = "host_doubling"
AUTO = "auto"
SETTINGS = (AUTO, RING, HALVING_DOUBLING, TREE, RING2D)  # RINGSERVE_ALGORITHM

# Per-frame software cost assumed when none is measured: the order of a frame's way through the
# executor, the codec and a gRPC stream on loopback (see docs/design/algorithms.md).
FRAME_S = 50e-6
# The least time per byte a measure of the links gives (10 GB/s): no link moves bytes faster than a
# core copies them, and a probe whose bytes took no time it could see (jitter larger than the
# transfer) would otherwise make every size latency-bound, and recursive doubling the fastest.
FASTEST_SECONDS_PER_BYTE = 1e-10
MIN_TREE_CHUNK = 16 << 10  # a tree's chunks are no smaller: a frame's header and its software
HEADER_BYTES = 96  # about a DATA frame's encoded header
# A ring whose ranks are all on hosts of their own runs a large block in frames of up to this many
# chunks (ring_chunk): between hosts a frame costs its sender and receiver a wake-up and a lane's
# thread hand-off, which 2 MiB frames paid 96 times per 64 MiB allreduce at world 4.
WIDE_CHUNKS = 4


@dataclass(frozen=True)
class LinkCosts:
    """The cost of one hop: ``latency_s`` + bytes * ``seconds_per_byte``, + ``frame_s`` a frame;
    and of reducing what arrives: ``reduce_s`` a byte (0 in figures given or measured, which
    describe links; the classes' figures carry it: REDUCE_IN_PLACE_S, REDUCE_RECEIVED_S)."""

    latency_s: float
    seconds_per_byte: float
    frame_s: float = FRAME_S
    reduce_s: float = 0.0

    @classmethod
    def of(cls, latency_s: float, bytes_per_s: float, frame_s: float = FRAME_S, reduce_s: float = 0.0) -> LinkCosts:
        return cls(latency_s, 1.0 / bytes_per_s, frame_s, reduce_s)


@dataclass(frozen=True)
class Measured(LinkCosts):
    """Link figures measured at start-up (worker/dataplane/calibration.py), where plain ``LinkCosts``
    are given (RINGSERVE_LINK_LATENCY_S and RINGSERVE_LINK_MBPS): ``auto`` plans by their class
    (``planned``), never by their value."""


# The time per byte a rank reduces, by where the received bytes lie (gamma in the model). On one
# host they lie in a shared-memory slot and are added in place: np.add of float32 measured 0.04-0.05
# ns a byte here, and recursive doubling over 2 ranks, which reduces S where the ring reduces S / 2,
# took 0.78x the ring's best time at 1 MiB and 1.02x at 4 MiB (0.05 ns makes 4 MiB the tie). Between
# hosts a lane or the stream first reads them into a buffer of their own: there the same recursive
# doubling took 1.24x the ring's best time at 1 MiB and 1.13x at 4 MiB over veth, where the model
# without gamma put it at 0.90x and 0.99x; 0.25 ns a byte explains 4 MiB (2026-12-06, 16
# interleaved rounds each, benchmarks/allreduce.py --algorithms auto ring; docs/design/algorithms.md).
REDUCE_IN_PLACE_S = 0.05e-9
REDUCE_RECEIVED_S = 0.25e-9
# The classes of a ring's links, and the figures auto plans each by. LAN: 50 us and 10 Gbit/s (the
# LAN of docs/design/algorithms.md's tables); WAN: 20 ms and 100 Mbit/s (the simulator's and the WAN
# benchmark's). One host plans by a LAN's hop (on it a hop's cost is the software's, as between
# hosts), but reduces in place.
HOST = "host"
LAN = "lan"
WAN = "wan"
HOST_LINKS = LinkCosts.of(50e-6, 10e9 / 8, reduce_s=REDUCE_IN_PLACE_S)
LAN_LINKS = LinkCosts.of(50e-6, 10e9 / 8, reduce_s=REDUCE_RECEIVED_S)
WAN_LINKS = LinkCosts.of(0.020, 100e6 / 8, reduce_s=REDUCE_RECEIVED_S)
CLASS_LINKS = {HOST: HOST_LINKS, LAN: LAN_LINKS, WAN: WAN_LINKS}
# LinkCosts across hosts measured at least this one way are a WAN's (a round trip of 16 ms): see planned.
WAN_LATENCY_S = 8e-3


def one_host(hosts: tuple[int, ...], n: int) -> bool:
    """Whether every rank of a ring of ``n`` ranks on ``hosts`` (each rank's host, as the view
    says; empty: not known) is on one host."""
    return len(hosts) == n and len(set(hosts)) == 1


def link_class(links: LinkCosts, hosts: tuple[int, ...], n: int) -> str:
    """The class of a ring of ``n`` ranks on ``hosts`` (each rank's host, as the view says; empty:
    not known) whose links measured ``links``: HOST where every rank is on one host, whatever was
    measured; else WAN from WAN_LATENCY_S one way, LAN below it."""
    if one_host(hosts, n):
        return HOST
    return WAN if links.latency_s >= WAN_LATENCY_S else LAN


def planned(links: LinkCosts, *, hosts: tuple[int, ...], n: int) -> LinkCosts:
    """The figures ``auto`` (and ``halving_doubling``'s choice of its two forms) plans a ring of
    ``n`` ranks on ``hosts`` by: given figures as they are (a static fact, the user's word);
    measured ones (``Measured``) as their class's (``link_class``, CLASS_LINKS).

    Static facts first, so that two runs of one job on the same machines plan alike, and sum in
    the same order (NCCL and gloo, too, choose from static facts). A measured figure moves with the
    machine's load: over eight rounds, one machine's loopback measured 0.18 ms to 3 ms one way and
    1.9 to 11 ns a byte from one start to the next, and within that range the model's best
    plan changes at many points (over worlds 2 to 16 and sizes 4 KiB to 64 MiB, up to four
    algorithms for one call), so that no bucket inside it is safe: a boundary there is crossed by
    noise, and the sums differ in their last bits (four tests had to run the ring by name).

    So measured figures pick between two classes only, at one threshold far from that noise: a
    ring across hosts is a WAN from 8 ms one way, over twice the most a loaded loopback measured,
    where a WAN between regions is 10 ms or more (and a measure, the shortest of eight round trips,
    never reads less than the wire's delay: load only adds). A ring on one host never reads as a
    WAN. Bandwidth is left out: three 60 KiB frames measure it within a factor of ten at best, and
    a link's class already sets it. Where a job knows its links better, it gives the figures.
    """
    if not isinstance(links, Measured):
        return links
    return CLASS_LINKS[link_class(links, hosts, n)]


@dataclass(frozen=True)
class Plan:
    """What a call runs: ``algorithm``, in chunks of at most ``chunk_bytes``, predicted to take
    ``seconds``."""

    algorithm: str
    chunk_bytes: int
    seconds: float


def _frames(nbytes: float, chunk: int) -> int:
    return max(1, math.ceil(nbytes / chunk))


def _ring_step(segment: float, links: LinkCosts, chunk_bytes: int, least_frames: int = 1) -> float:
    """One step of a pipelined ring that moves ``segment`` bytes: its bytes, or, when they take
    less than a hop's latency, the hop (a chunk must arrive before the next step's leaves)."""
    a, b, f = links.latency_s, links.seconds_per_byte, links.frame_s
    frames = max(_frames(segment, chunk_bytes), least_frames)
    return max(segment * b + f * frames, a + min(segment, chunk_bytes) * b + f)


def predict(algorithm: str, nbytes: int, n: int, links: LinkCosts, chunk_bytes: int) -> Plan:
    """The predicted time of an allreduce of ``nbytes`` over ``n`` ranks under ``algorithm``."""
    a, b, f, g = links.latency_s, links.seconds_per_byte, links.frame_s, links.reduce_s
    s = float(nbytes)
    if n <= 1:
        return Plan(algorithm, chunk_bytes, 0.0)
    p = power_below(n)
    fold = 0.0 if p == n else 2 * (a + s * b + f * _frames(s, chunk_bytes)) + s * g
    if algorithm == RING:
        t = 2 * (n - 1) * _ring_step(s / n, links, chunk_bytes) + (n - 1) / n * s * g
    elif algorithm == HALVING_DOUBLING:
        k = p.bit_length() - 1
        t = (2 * k * a + 2 * (p - 1) / p * s * b + f * 2 * (_frames(s / p, chunk_bytes) * (p - 1))
             + (p - 1) / p * s * g + fold)
    elif algorithm == RECURSIVE_DOUBLING:
        k = p.bit_length() - 1
        t = k * (a + s * b + f * _frames(s, chunk_bytes) + s * g) + fold
    elif algorithm == TREE:
        return _tree(s, n, links, chunk_bytes)
    elif algorithm == RING2D:
        rows, cols = grid(n)
        if rows < 2:
            return predict(RING, nbytes, n, links, chunk_bytes)
        # A row step moves a segment in frames of its tiles: at least one a row.
        t = 2 * (cols - 1) * _ring_step(s / cols, links, chunk_bytes, rows) + 2 * (rows - 1) * _ring_step(
            s / n, links, chunk_bytes) + (n - 1) / n * s * g
    else:
        raise ValueError(f"No cost model for the algorithm {algorithm!r}.")
    return Plan(algorithm, chunk_bytes, t)


def tree_chunk(nbytes: int, n: int, chunk_bytes: int) -> int:
    """The chunk of a pipelined tree: about 16 x depth chunks per half, so that filling the
    pipeline (2 x depth chunk hops) costs about a sixteenth of the bandwidth term, within
    [MIN_TREE_CHUNK, chunk_bytes], a multiple of 1 KiB. A function of the call, the world and the
    config only (not of the link figures), so that a rank that stands in for a tree allreduce
    (join.py) chunks it as the others do."""
    depth = max(tree_depth(n), 1)
    chunk = (nbytes // 2 // (16 * depth)) >> 10 << 10
    return int(min(max(chunk, MIN_TREE_CHUNK), chunk_bytes))


def ring_chunk(nbytes: int, n: int, chunk_bytes: int, *, apart: bool) -> int:
    """The chunk a ring allreduce (or reduce-scatter) of ``nbytes`` over ``n`` ranks runs in:
    ``chunk_bytes``, unless every rank is on a host of its own (``apart``); then half a block (two
    frames per step, so a frame's reduction overlaps the next one's transfer), within
    [chunk_bytes, WIDE_CHUNKS x chunk_bytes], a multiple of 1 KiB. The stream's and the lane's
    frame caps and a shared-memory slot (containers of one host count as apart) hold the widest
    (config.frame_bytes). A function of the call, the view and the config only, so every rank of
    the ring (and a rank that stands in, join.py) chunks alike."""
    if not apart or n <= 1:
        return chunk_bytes
    half = (nbytes // n // 2) >> 10 << 10
    return int(min(max(half, chunk_bytes), WIDE_CHUNKS * chunk_bytes))


def _tree(s: float, n: int, links: LinkCosts, chunk_bytes: int) -> Plan:
    """The double binary tree, pipelined: each tree carries S/2 in chunks of ``t`` bytes. The
    first chunk climbs and comes down 2D hops; after it, a node inside one tree and a leaf of the
    other sends 4 chunks per chunk of each half (one up in each tree, two down), so the pipeline
    runs at one chunk per 4 t beta. A node inside one tree reduces its two children's halves: S
    in all."""
    a, b, f = links.latency_s, links.seconds_per_byte, links.frame_s
    depth = max(tree_depth(n), 1)
    chunk = tree_chunk(int(s), n, chunk_bytes)
    per = min(chunk, max(s / 2, 1.0))
    count = _frames(s / 2, chunk)
    t = 2 * depth * (a + per * b + f) + (count - 1) * (4 * per * b + 4 * f) + s * links.reduce_s
    return Plan(TREE, chunk, t)


def candidates(op: str, n: int, *, coded: bool) -> tuple[str, ...]:
    """The algorithms that can run ``op`` (allreduce, reduce_scatter, allgather, broadcast) over n
    ranks: a reduce-scatter and an allgather by halving-doubling need a power-of-two world."""
    if n <= 1:
        return (RING,)
    pow2 = n & (n - 1) == 0
    if op == "allreduce":
        found = [RING, HALVING_DOUBLING, TREE]
        if not coded:
            found.append(RECURSIVE_DOUBLING)
        if grid(n)[0] >= 2:
            found.append(RING2D)
        return tuple(found)
    if op in ("reduce_scatter", "allgather"):
        return (RING, HALVING_DOUBLING) if pow2 else (RING,)
    if op == "broadcast":
        return (RING, TREE)
    return (RING,)


def _predict_op(op: str, algorithm: str, nbytes: int, n: int, links: LinkCosts, chunk_bytes: int) -> Plan:
    """Costs of the other collectives: half an allreduce (reduce-scatter, allgather), or a
    broadcast's chain (n - 1 hops, then a commit lap) against its tree (3 D hops, twice the bytes
    at inner nodes)."""
    a, b, f = links.latency_s, links.seconds_per_byte, links.frame_s
    s = float(nbytes)
    if op == "allreduce":
        return predict(algorithm, nbytes, n, links, chunk_bytes)
    if op in ("reduce_scatter", "allgather"):
        if algorithm == RING:
            return Plan(RING, chunk_bytes, (n - 1) * (a + f + s / n * b))
        k = n.bit_length() - 1
        return Plan(algorithm, chunk_bytes, k * (a + f) + (n - 1) / n * s * b)
    if op == "broadcast":
        frames = _frames(s, chunk_bytes)
        if algorithm == RING:
            return Plan(RING, chunk_bytes, (2 * n - 1) * (a + f) + s * b + (n - 2) * min(s, chunk_bytes) * b + frames * f)
        depth = max(tree_depth(n), 1)
        return Plan(TREE, chunk_bytes, 3 * depth * (a + f) + 2 * s * b + depth * min(s, chunk_bytes) * b + 2 * frames * f)
    return Plan(RING, chunk_bytes, 0.0)


# By host (hierarchy.py) under auto only where predicted at most this fraction of the flat plan's time.
# 0.80: at 0.85, 4 hosts of 2 ranks ran 16 MiB by host (the model's 0.83), and measured 1.02, 1.08,
# 0.88, 0.93 and 1.29 times the flat ring (medians of 10 interleaved rounds each over veth,
# 2026-12-06; best of rounds 0.97-1.15): no gain shown, and a loss in the last. With 2 ranks a host
# the cross stage saves only 2 S (1/hosts - 1/n) of the flat ring's bytes per uplink, and the two
# stages within the host, counted free, are not. Only 4 x 2 at 16 and 64 MiB (0.83) change.
BY_HOST_MARGIN = 0.80
# Under auto, an allreduce by another algorithm than the ring only where predicted at most this fraction
# of the ring's time. The model leaves out what favours the ring: one frame a step to one neighbour while taking one
# from the other, every step pipelined, the simplest program. Measured between 4 hosts on veth (2026-12-03,
# 5 interleaved rounds each): a 2D ring the model put at 0.84-0.98x the ring took 1.1x its time at 1 MiB
# and 1.3x at 4 MiB, and halving-doubling 1.1-1.2x at 1 MiB (docs/design/algorithms.md). Not over 2
# ranks: there both neighbours are one rank, and recursive doubling's one exchange is measured faster
# (1 MiB on one host: 1.10 ms against the ring's 1.64).
RING_MARGIN = 0.8
# Plans remembered: a plan is a pure function of the call's size, the world and the link figures,
# and a training loop asks the same few questions on every step (about 15 predictions a call by host).
PLANS_KEPT = 4096


@functools.lru_cache(maxsize=PLANS_KEPT)
def by_host(nbytes: int, local: int, hosts: int, links: LinkCosts, chunk_bytes: int) -> bool:
    """Whether an allreduce of ``nbytes`` over ``hosts`` hosts of ``local`` ranks each runs by host
    under ``auto`` (a reduce-scatter within each host, an allreduce of each 1/local slice across
    hosts, an allgather within each host: worker/ops/hierarchy.py) rather than flat over all ranks.

    A host's uplink is shared by its ranks wherever they cross hosts at once: the ``local``
    concurrent cross stages, or a flat algorithm's exchanges with partners on other hosts (each gets
    1/local of its bandwidth); only the flat ring, whose neighbours share a host but for one, crosses
    once per host. The local stages move bytes at memory speed and are counted as free. By host only
    where that is clearly faster than the best flat plan (``BY_HOST_MARGIN``): its three stages run
    one after the other, where the flat plan pipelines everything, and where the two are close (a
    large tensor over few ranks per host against the flat ring, whose cross-host bytes differ by
    2 S (1/hosts - 1/n) only) the model's error is larger than the gain. Small tensors win by host:
    log2(hosts) hops instead of log2(n).
    """
    flat = flat_plan(nbytes, local, hosts, links, chunk_bytes).seconds
    cross = across_hosts(AUTO, nbytes, local, hosts, links, chunk_bytes).seconds
    return cross < BY_HOST_MARGIN * flat


def _over_hosts(links: LinkCosts, local: int) -> LinkCosts:
    """The figures a ring of hosts of ``local`` ranks each is planned by (by_host, across_hosts,
    flat_plan): each rank's share of its host's uplink, and no cost per byte reduced.

    Gamma is left out here because these plans count the stages within a host as free, and
    measured, that omission outweighs gamma. Over 2 hosts of 4 ranks (veth, 2026-12-06), recursive
    doubling across hosts as one program (host_doubling: the leaders reduce the whole vector) took
    0.85x the flat ring at 16 MiB; gamma made the model take the three stages instead (by its cross
    stage alone, within 3% of recursive doubling), whose two rings within each host add 2 (L - 1)
    steps, and those took 1.48x the ring (median of 6 rounds; best 1.05x). Until the local stages are
    in the model, plans by host stay as they were measured."""
    return LinkCosts(links.latency_s, links.seconds_per_byte * local, links.frame_s)


@functools.lru_cache(maxsize=PLANS_KEPT)
def across_hosts(setting: str, nbytes: int, local: int, hosts: int, links: LinkCosts, chunk_bytes: int) -> Plan:
    """The plan of a by-host allreduce's stage across ``hosts`` hosts, each of whose ``local`` ranks
    carries 1/local of ``nbytes`` over the uplink they share, by the whole view's link figures (so
    that every rank, whichever ring across hosts it is in, plans alike: worker/ops/hierarchy.py)."""
    return choose(setting, "allreduce", -(-nbytes // local), hosts, _over_hosts(links, local), chunk_bytes)


@functools.lru_cache(maxsize=PLANS_KEPT)
def flat_plan(nbytes: int, local: int, hosts: int, links: LinkCosts, chunk_bytes: int) -> Plan:
    """The best flat allreduce over ``hosts`` hosts of ``local`` ranks each (under ``auto``, where
    by_host says flat): the ring, which crosses each host's uplink once, or the best other plan
    with the uplink shared by the host's ranks, whose partners on other hosts it reaches at once.
    Planned with each rank's own link figures, a 2D ring or a halving-doubling looks faster than
    the ring at 64 MiB over 8 hosts of 2, and took 1.3x to 2.4x its time (docs/design/algorithms.md).
    """
    n = local * hosts
    ring = predict(RING, nbytes, n, _over_hosts(links, 1), chunk_bytes)
    other = choose(AUTO, "allreduce", nbytes, n, _over_hosts(links, local), chunk_bytes)
    return ring if ring.seconds <= other.seconds else other


@functools.lru_cache(maxsize=PLANS_KEPT)
def choose(setting: str, op: str, nbytes: int, n: int, links: LinkCosts | None, chunk_bytes: int, *,
           coded: bool = False) -> Plan:
    """The plan for one call: ``setting`` (RINGSERVE_ALGORITHM) when it names an algorithm that can
    run the call, the ring when it cannot; under ``auto`` the fastest predicted.

    ``halving_doubling`` lets the model pick recursive doubling, its small-message form, where it
    is faster. ``links`` None (auto before any figures): the ring.

    Raises:
        ValueError: ``setting`` is not one of SETTINGS.
    """
    if setting not in SETTINGS:
        raise ValueError(f"The algorithm {setting!r} is not one of {', '.join(SETTINGS)}.")
    able = candidates(op, n, coded=coded)
    if setting == RING or n <= 1:
        return _predict_op(op, RING, nbytes, n, links, chunk_bytes) if links is not None else Plan(RING, chunk_bytes, 0.0)
    if setting == AUTO:
        if links is None:
            return Plan(RING, chunk_bytes, 0.0)
        pool = able
    elif setting == HALVING_DOUBLING:
        pool = tuple(a for a in able if a in (HALVING_DOUBLING, RECURSIVE_DOUBLING))
    else:
        pool = tuple(a for a in able if a == setting)
    if not pool:
        return Plan(RING, chunk_bytes, 0.0)
    if links is None:  # a named algorithm with no figures: its plain form
        return Plan(pool[0], chunk_bytes, 0.0)
    plans = [_predict_op(op, a, nbytes, n, links, chunk_bytes) for a in pool]
    best = min(plans, key=lambda plan: plan.seconds)
    if setting == AUTO and op == "allreduce" and n > 2 and best.algorithm != RING:
        ring = predict(RING, nbytes, n, links, chunk_bytes)
        if best.seconds > RING_MARGIN * ring.seconds:
            return ring
    return best
