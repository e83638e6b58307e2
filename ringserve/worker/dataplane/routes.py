"""Which ranks a collective's frames come from and go to, by its algorithm: pure.

A ring's frames come from the ring's predecessor and go to its successor. The other algorithms
(topology.py) talk to a few more peers, and the plane must know which before the collective opens
here, to check the sender of a frame that arrives early. So a collective that runs another
algorithm says so in its descriptor (`` algo=<name>``, which every frame carries): ranks that
disagree on the algorithm then disagree on the descriptor, and fail with MismatchError as for any
other argument, and the plane checks each frame's sender against the algorithm that frame claims.

Every algorithm may also hear from the ring's predecessor and send to its successor: aborts go
round the ring (aborts.py), and so does the confirmation lap that checksums add (programs/executor.py).

A broadcast's tree depends on its root: its algorithm is ``tree/<root position>``. The measure of a
ring's links (``probe``) pings both ring neighbours, then agrees by recursive doubling.
"""

from __future__ import annotations

from functools import lru_cache

from ringserve import topology
from ringserve.errors import ProtocolError
from ringserve.selection import HALVING_DOUBLING, HOST_DOUBLING, RECURSIVE_DOUBLING, RING, RING2D, TREE
from ringserve.worker.dataplane.descriptor import Descriptor, changed
from ringserve.worker.dataplane.programs import Ring

PROBE = "probe"  # the measure of the links (worker/dataplane/calibration.py): pings both ways, then doubling
ALGORITHMS = (RING, HALVING_DOUBLING, RECURSIVE_DOUBLING, TREE, RING2D, HOST_DOUBLING, PROBE)  # names from selection.py

TOKEN = " algo="
_PROBLEM = " invalid: "


def algorithm_of(descriptor: str | Descriptor) -> str:
    """The algorithm a descriptor (or a frame's descriptor text) names (``ring`` when it names none).

    On the text, the field is looked for before a refusal's free-form problem only, which may say anything.
    """
    if isinstance(descriptor, Descriptor):
        return descriptor.algo or RING
    end = descriptor.find(_PROBLEM)
    at = descriptor.find(TOKEN, 0, len(descriptor) if end < 0 else end)
    if at < 0:
        return RING
    return descriptor[at + len(TOKEN):].split(" ", 1)[0]


def tagged(descriptor: Descriptor, algorithm: str) -> Descriptor:
    """``descriptor`` naming ``algorithm`` (a ring's names none)."""
    return changed(descriptor, "algo", "" if algorithm == RING else algorithm)


def untagged(descriptor: Descriptor) -> Descriptor:
    """``descriptor`` without the algorithm it names."""
    return changed(descriptor, "algo", "")


def rooted(root: int) -> str:
    """The algorithm of a tree broadcast from position ``root``."""
    return f"{TREE}/{root}"


def by_hosts_of(local: int) -> str:
    """The algorithm of recursive doubling by host over hosts of ``local`` consecutive positions."""
    return f"{HOST_DOUBLING}/{local}"


def _positions(algorithm: str, n: int, pos: int) -> tuple[frozenset[int], frozenset[int]]:
    """(positions heard from, positions sent to) by ``pos`` of ``n``, besides the ring neighbours.

    An algorithm this rank does not know (a newer peer's) has none: its frames are refused.
    """
    name, _, root = algorithm.partition("/")
    if name in (HALVING_DOUBLING, RECURSIVE_DOUBLING):
        peers = topology.hd_peers(n, pos)
        return peers, peers
    if name == TREE and root.isdigit() and int(root) < n:
        peers = topology.tree_peers(n, pos, int(root))
        return peers, peers
    if name == TREE and not root:
        peers = topology.tree_peers(n, pos)
        return peers, peers
    if name == RING2D:
        return topology.grid_peers(n, pos)
    if name == HOST_DOUBLING and root.isdigit() and int(root) > 0 and n % int(root) == 0:
        return _host_peers(n, pos, int(root))
    if name == PROBE:
        peers = topology.hd_peers(n, pos) | {(pos - 1) % n, (pos + 1) % n}
        return peers, peers
    return frozenset(), frozenset()


def _host_peers(n: int, pos: int, local: int) -> tuple[frozenset[int], frozenset[int]]:
    """A host's positions talk to its leader (its first); a leader to them and, by recursive
    doubling, to other leaders (programs_hd.host_doubling)."""
    host, offset = divmod(pos, local)
    leader = host * local
    if offset:
        return frozenset({leader}), frozenset({leader})
    peers = frozenset(range(leader + 1, leader + local)) | {h * local for h in topology.hd_peers(n // local, host)}
    return peers, peers


@lru_cache(maxsize=1024)
def _ranks(algorithm: str, ring: Ring) -> tuple[frozenset[int], frozenset[int]]:
    n, me = ring.size, ring.index
    if n == 1:
        return frozenset(), frozenset()
    heard, sent = _positions(algorithm, n, me)
    members = ring.members
    sources = {members[p] for p in heard} | {members[(me - 1) % n]}
    sinks = {members[p] for p in sent} | {members[(me + 1) % n]}
    return frozenset(sources), frozenset(sinks)


def check_sender(descriptor: str, key: str, ring: Ring, sender: int, view_id: int) -> None:
    """Checks that a frame of ``key`` with ``descriptor`` ("" for an abort, which goes round the
    ring) may come to this rank of ``ring`` from ``sender``.

    Raises:
        ProtocolError: it may not: a broken peer or program.
    """
    algorithm = algorithm_of(descriptor)
    me = ring.members[ring.index]
    if algorithm == RING:
        source = ring.members[(ring.index - 1) % ring.size] if ring.size > 1 else -1
        if sender != source:
            raise ProtocolError(
                f"A frame of collective {key!r} came from rank {sender}, but rank {me} of view "
                f"{view_id} receives that collective's frames from rank {source} only."
            )
    elif sender not in sources(algorithm, ring):
        raise ProtocolError(
            f"A frame of collective {key!r} ({algorithm}) came from rank {sender}, but rank {me} of view "
            f"{view_id} receives that collective's frames from ranks {sorted(sources(algorithm, ring))} only."
        )


def sources(algorithm: str, ring: Ring) -> frozenset[int]:
    """The ranks whose frames of a collective running ``algorithm`` over ``ring`` may reach this rank."""
    return _ranks(algorithm, ring)[0]


def sinks(algorithm: str, ring: Ring) -> frozenset[int]:
    """The ranks a collective running ``algorithm`` over ``ring`` sends to from this rank."""
    return _ranks(algorithm, ring)[1]
