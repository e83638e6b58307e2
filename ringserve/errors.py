"""The one error tree of ringserve.

Errors are split by what a caller does next, as Horovod's elastic mode splits them:

```python
RuntimeError
└── RingserveError
    ├── RecoverableError          restore the last commit, wait for the next view, retry
    │   ├── PeerUnavailableError  a ring neighbour stopped answering
    │   ├── RingChangedError      the view changed under a collective (old and new view named)
    │   ├── CollectiveTimeoutError  a collective passed its deadline
    │   │   └── GroupTimedOutError  an op of a torch group that an earlier timeout broke
    │   ├── CorruptFrameError     a chunk failed its checksum: aborted on every rank, never summed
    │   ├── GroupMemberFailedError  a step failed on another rank of this HSDP replica group
    │   └── ShardUnavailableError  a parameter-server shard did not answer, nor come back in time
    ├── NonFiniteError            a reduced result holds NaN or Inf (raised on every rank alike)
    ├── HostsUpdatedInterrupt     membership changes at a commit: wait for the view, no rollback
    ├── ReplicaGroupLostError     a rank of this HSDP replica group died: exit, the group restarts
    ├── StateLostError            every worker holding the last commit died and no durable copy
    │                             exists: the job cannot go on without going back; never retried
    ├── CoordinatorUnreachableError  the coordinator did not answer within its deadline
    ├── TLSHandshakeError         a server and a client could not agree on TLS (which side, why)
    ├── PayloadLaneError          RINGSERVE_PAYLOAD_LANE=tcp and an edge's TCP payload lane could
    │                             not attach (the port and the reason named): a deployment to fix
    ├── ExcludedError             cut off from the coordinator, the peers went on without us: stop
    ├── RendezvousTimeoutError    no view formed within the rendezvous deadline
    ├── ViewInstallError          this worker could not take its place in a view; it left the world
    ├── WorkerFailedError         a task the worker needs (heartbeat, view watch) crashed; it left
    └── UsageError                a bug in the calling program; retrying will not help
        ├── NotInitializedError   a collective called before init()
        ├── InvalidArgumentError  an unknown op, a root out of range, an unsupported dtype
        ├── MismatchError         ranks disagree on a collective's shape, dtype, op or root
        ├── UnsupportedError      not supported in this configuration (Adasum on a world whose
        │                         size is not a power of two, as in Horovod)
        ├── ProtocolError         a malformed or unexpected frame
        └── MissingExtraError     a framework binding's extra is not installed (an ImportError)
```

``grpc.aio.AioRpcError`` is translated at the transport boundary and never reaches users.

Every error is a ``RuntimeError``, as every error Horovod raises from a collective is (its
``HorovodInternalError`` and ``HostsUpdatedInterrupt`` are): code written for Horovod catches
``RuntimeError`` around collectives, and a mismatch must land there too. The tree below
``RingserveError`` keeps what Horovod's one internal error blurs (a mismatch is a usage error,
which elastic training must not retry). ``InvalidArgumentError`` and ``NotInitializedError`` are
also ``ValueError``s, as Horovod's argument errors and its calls before ``init()`` are.
"""

from __future__ import annotations

from collections.abc import Mapping


class RingserveError(RuntimeError):
    """Base class of every error ringserve raises (a RuntimeError, as Horovod's are)."""


class RecoverableError(RingserveError):
    """The world changed or a peer failed: state can be restored and the work retried."""


class PeerUnavailableError(RecoverableError):
    """A ring neighbour could not be reached or dropped its stream."""


class RingChangedError(RecoverableError):
    """A collective of one view cannot finish because a newer view replaced it."""

    def __init__(self, old_view: int, new_view: int, detail: str = "") -> None:
        self.old_view = old_view
        self.new_view = new_view
        message = f"The ring changed from view {old_view} to view {new_view}"
        super().__init__(f"{message}: {detail}" if detail else message + ".")


class CollectiveTimeoutError(RecoverableError):
    """A collective did not finish within its deadline."""


class GroupTimedOutError(CollectiveTimeoutError):
    """An op of a torch.distributed group that an earlier timeout broke, on any rank of it: the
    cause of its DistBackendError (ringserve/torch/distributed/breaker.py)."""


class CorruptFrameError(RecoverableError):
    """A frame failed its checksum; its collective was aborted on every rank and nothing was summed."""

    def __init__(self, op_key: str, detail: str) -> None:
        self.op_key = op_key
        super().__init__(f"Collective {op_key!r} was aborted on every rank: {detail}")


class ShardUnavailableError(RecoverableError):
    """A parameter-server shard stopped answering and was not listed alive again within the wait."""

    def __init__(self, shard: int, address: str, waited_s: float, detail: str = "") -> None:
        self.shard = shard
        self.address = address
        message = f"Parameter-server shard {shard} (last at {address or 'no address yet'}) was not available within {waited_s:g} s"
        super().__init__(f"{message}: {detail}" if detail else message + ".")


class GroupMemberFailedError(RecoverableError):
    """A step of the elastic world passed on this rank and failed on another rank of its replica
    group (``ringserve.torch.hsdp``): every rank of the group restores its last commit, as those
    that failed do, so that none goes on alone into the group's next collective."""

    def __init__(self, group: str, rank: int) -> None:
        self.group = group
        self.rank = rank
        super().__init__(f"A step failed on another rank of replica group {group!r} (this is its rank {rank}); "
                         f"the whole group restores its last commit")


class ReplicaGroupLostError(RingserveError):
    """A rank of this process's replica group (``ringserve.torch.hsdp``) died: the group's own
    backend failed under it. The group's shards cannot be served any more; the process should
    exit, and its launcher start the whole group again (it then rejoins as a new group)."""

    def __init__(self, group: str, rank: int, detail: str) -> None:
        self.group = group
        self.rank = rank
        super().__init__(f"Replica group {group!r} lost a rank (this is its rank {rank}): its process group "
                         f"failed ({detail}); exit, and start the group again whole")


class NonFiniteError(RingserveError):
    """A reduction's result holds NaN or Inf; every rank holds the same result, so every rank raises."""


class HostsUpdatedInterrupt(RingserveError):
    """Workers join or leave at this commit: the state is already committed, so no rollback."""

    def __init__(self, joining: int, leaving: int, detail: str = "") -> None:
        self.joining = joining
        self.leaving = leaving
        super().__init__(detail or f"The world changes at this commit: {joining} joining, {leaving} leaving.")


# The exit code of a worker process that ends on an uncaught StateLostError (see
# ringserve.elastic.run); ``ringserve run`` recognizes it, restarts nobody and ends the run with it.
# 65 is sysexits' EX_DATAERR: the data (the committed state) is gone, retrying cannot bring it back.
STATE_LOST_EXIT_CODE = 65


class StateLostError(RingserveError):
    """Every worker that held the job's last commit is gone, and no durable copy can replace it.

    Not recoverable by restoring and retrying: the survivors hold only an older state (a fresh
    process holds the initial one), and going on from it would silently undo committed training.
    Raised on every rank of the view that found the loss.

    Attributes:
        step: the last commit the job is known to have made.
        holders: who held it, as "rank R of view V (worker ID at ADDRESS)".
        view: the view that found it lost.
        best: the furthest commit any member of that view holds.
    """

    exit_code = STATE_LOST_EXIT_CODE

    def __init__(self, *, step: int, holders: list[str], view: int, best: int, detail: str = "") -> None:
        self.step = step
        self.holders = list(holders)
        self.view = view
        self.best = best
        held = "; ".join(self.holders) or "workers the coordinator no longer knows"
        message = (
            f"The job's committed state is lost: every worker holding commit {step} died ({held}), "
            f"and no member of view {view} holds more than commit {best}"
        )
        super().__init__(f"{message}; {detail}" if detail else message + ".")


class CoordinatorUnreachableError(RingserveError):
    """The coordinator at an address did not answer within the deadline, or refused the
    connection (``waited`` False: the call failed at once, so no deadline is named)."""

    def __init__(self, address: str, deadline_s: float, detail: str = "", *, waited: bool = True) -> None:
        self.address = address
        message = f"The coordinator at {address} could not be reached" + (f" within {deadline_s:g} s" if waited else "")
        super().__init__(f"{message}: {detail}" if detail else message + ".")


class TLSHandshakeError(RingserveError):
    """A connection failed in its TLS handshake, or one side spoke TLS and the other did not.

    Not a CoordinatorUnreachableError: the server is up, and waiting or retrying will not help
    until the certificates or settings change. ``refused_by`` is "client" or "server", the side
    that ended the handshake; ``cause`` says why in a sentence.
    """

    def __init__(self, address: str, refused_by: str, cause: str) -> None:
        self.address = address
        self.refused_by = refused_by
        self.cause = cause
        super().__init__(f"The TLS handshake with {address} failed, refused by the {refused_by}: {cause}")


class PayloadLaneError(RingserveError):
    """An edge's TCP payload lane could not attach where the lane is required
    (RINGSERVE_PAYLOAD_LANE=tcp): a firewall, a NAT or a proxy in the way, which retrying in a new
    view will not remove. A lane that breaks once attached fails its collectives with
    PeerUnavailableError, as a broken stream does."""


class ExcludedError(RingserveError):
    """The coordinator declared this worker dead, and its peers went on to a newer view without it.

    Not recoverable by design: the worker cannot reach the coordinator to join that view, and
    training on alone (or with others cut off with it) would be a second world. It stops instead.
    """

    def __init__(self, address: str, coordinator: str, silent_s: float, peer_view: int, own_view: int) -> None:
        self.peer_view = peer_view
        self.own_view = own_view
        super().__init__(
            f"The worker at {address} could not reach the coordinator at {coordinator} for {silent_s:.1f} s, "
            f"and its peers went on to view {peer_view} while it was in view {own_view}: the coordinator "
            f"declared it dead, so it stops rather than train as a second world."
        )


class RendezvousTimeoutError(RingserveError):
    """No view that includes this worker formed before the rendezvous deadline."""


class ViewInstallError(RingserveError):
    """This worker could not set up its place in a view (a setting the host refused, a file it
    could not write); it left the world, so the others get a view without it. The cause is chained.
    Retrying will fail again until the cause is fixed."""


class WorkerFailedError(RingserveError):
    """A background task the worker cannot do without (its heartbeats, its view watch) crashed.

    The worker left the world, so the others get a view without it at once; every call on it
    fails with this error from then on, the crash chained as the cause. Not recoverable: the
    worker's own machinery broke (a bug worth reporting), and a new worker must be started.
    """


class UsageError(RingserveError):
    """The calling program used ringserve wrongly; retrying the same call will fail again."""


class NotInitializedError(UsageError, ValueError):
    """A function that needs a running worker was called before init() or after shutdown().

    Also a ValueError, as Horovod's ``hvd.rank()`` before ``hvd.init()`` raises one."""


class InvalidArgumentError(UsageError, ValueError):
    """An argument is out of range or unsupported."""


class MismatchError(UsageError):
    """The ranks called the same collective with different shapes, dtypes, ops or roots."""

    def __init__(self, op_key: str, descriptors: Mapping[int, str]) -> None:
        self.op_key = op_key
        self.descriptors = dict(sorted(descriptors.items()))
        listing = "; ".join(f"rank {r}: {d}" for r, d in self.descriptors.items())
        super().__init__(
            f"The ranks called collective {op_key!r} with different arguments ({listing})."
        )


class UnsupportedError(UsageError, NotImplementedError):
    """What was asked is not supported in this configuration; also a NotImplementedError, as
    Horovod raises for the same cases (Adasum on a world whose size is not a power of two)."""


class ProtocolError(UsageError):
    """A peer sent a frame that breaks the wire contract."""


class MissingExtraError(UsageError, ImportError):
    """A binding needs a package that is not installed; the message names the extra that installs it
    (``pip install ringserve[keras]``). Also an ImportError, as a missing package is."""
