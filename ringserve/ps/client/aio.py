"""The parameter server's client, over asyncio: init, pull and push, whatever the framework.

A client belongs to one worker (its id names its pushes, and a view it is in makes it a member
that sync, ssp and average count). It finds the shards in the coordinator's directory, cuts the
model into their pieces (layout.py), and keeps ``values``, the values it last pulled. Per shard it
keeps the step it pushes next, so each mode's rule is one line (see rules.py for the shard's side):

- sync, average: it computes on version ``v``, pushes round ``v``, and pulls with
  ``min_version v + 1``, which waits for the round;
- ssp: it pushes its clock ``c`` and pulls for ``c + 1``, which waits for the slowest member.
  The clock is the worker's, one for every shard: should the shards count it differently (one
  refused a push as stale, or came back from a checkpoint, or started a joiner at a slower
  member's clock than another did), each pull sets every shard's to the furthest, and the pull's
  ``next_step`` tells the shards that were behind. A worker whose shards kept different clocks
  would push its last steps to one shard after it had finished with the other: pushes that
  reach that shard after the others' final pull;
- async: it pushes and pulls at will.

A push goes to every shard at once (a shard none of whose pieces it carries still gets its
header: sync counts one push per member), as a stream of chunks encoded with the wire codec. A
shard that stops answering, or whose stream breaks mid-call (verdicts.py tells these from its
refusals), is waited for in the directory and asked again: pushes are idempotent per (worker,
step), so a retried push is applied once. A shard that came back empty (no checkpoint) is seeded
again with the values this client last pulled. A call that fails on one shard cancels those to
the others, and they end before its error reaches the caller.

Example:
    ```python
    client = AsyncClient(PSClientConfig(coordinator=addr), worker_id=worker.worker_id, view=view_of(worker))
    await client.connect()
    await client.init({"w": w, "b": b}, mode="ssp", staleness=2, optimizer=Optimizer(kind="sgd", lr=0.1))
    values = await client.pull()
    await client.push({"w": grad_w, "b": grad_b})
    ```
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Protocol, TypeVar

import grpc
import numpy as np

from ringserve._proto import peer_pb2
from ringserve._proto import ps_pb2 as pb
from ringserve.codecs import codec as codec_named
from ringserve.config import PSClientConfig
from ringserve.errors import InvalidArgumentError, NotInitializedError, RingserveError
from ringserve.ps.client.shards import ShardLink, ShardLinks, translate
from ringserve.ps.jobs import Job, piece_proto
from ringserve.ps.layout import Layout, Piece, partition, specs_of
from ringserve.ps.optim import Optimizer
from ringserve.ps.rules import MEMBER_MODES, ROUND_MODES, check_mode
from ringserve.ps.verdicts import is_transient
from ringserve.security import Security

T = TypeVar("T")

class _Member(Protocol):
    @property
    def view_id(self) -> int: ...


def view_of(worker: _Member) -> Callable[[], int]:
    """The view a worker (ringserve.Worker) is a member of now, 0 between views: what a client
    sends with its pushes and pulls (a push from no view is STALE in sync, ssp and average)."""

    def view() -> int:
        try:
            return worker.view_id
        except RingserveError:  # between views: excluded, or waiting to be admitted again
            return 0

    return view


def first_error(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first error of a TaskGroup's group (the one that cancelled the other tasks), with the
    others noted on it."""
    error = group.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    others = group.exceptions[1:]
    if others:
        error.add_note(f"{len(others)} more shard call(s) failed at the same time: "
                       + "; ".join(f"{type(e).__name__}: {e}" for e in others))
    return error


DEFAULT_OPTIMIZER = Optimizer()  # frozen: plain SGD at lr 0.01, torch's default
OUTCOMES = {pb.APPLIED: "applied", pb.ACCEPTED: "accepted", pb.DUPLICATE: "duplicate", pb.STALE: "stale"}


class AsyncClient:
    """A worker's client of the parameter-server shards (see the module docstring)."""

    def __init__(self, config: PSClientConfig | None = None, *, worker_id: str, view: Callable[[], int] = lambda: 0,
                 security: Security | None = None) -> None:
        """Args:
            config: deadlines, chunk size and push codec.
            worker_id: this worker's id (the coordinator's, for a member of a view).
            view: the view the worker is in now (0: none, for async only).
            security: TLS and token (default: loaded from the config).
        """
        if not worker_id:
            raise InvalidArgumentError("A parameter-server client needs its worker's id.")
        self.config = config or PSClientConfig()
        self.worker_id = worker_id
        self._view = view
        self._links = ShardLinks(self.config, security or Security.load(self.config))
        self._codec = codec_named(self.config.push_codec)
        self.layout: Layout | None = None
        self.jobs: list[Job] = []
        self.mode = ""
        self.values: dict[str, np.ndarray] = {}
        self.counts: Counter[str] = Counter()
        self._busy: asyncio.Lock | None = None

    @property
    def links(self) -> list[ShardLink]:
        return self._links.links

    @property
    def versions(self) -> list[int]:
        """The version last pulled from each shard."""
        return [link.version for link in self._links.links]

    @property
    def lost_updates(self) -> int:
        """Updates the shards' restarts lost, as they report them."""
        return sum(link.lost_updates for link in self._links.links)

    async def connect(self) -> int:
        """Waits until the coordinator lists every shard alive; returns S (see ShardLinks.connect)."""
        return await self._links.connect()

    async def close(self) -> None:
        await self._links.close()

    # -- the job ---------------------------------------------------------------------------

    async def init(self, tensors: Mapping[str, np.ndarray] | Sequence[tuple[str, np.ndarray]], *,
                   mode: str = "sync", optimizer: Optimizer | Sequence[Optimizer] = DEFAULT_OPTIMIZER,
                   groups: Mapping[str, int] | None = None, staleness: int = 0, sum: bool = False,
                   max_lag: int = 0, seed: bool = True) -> bool:
        """Declares the job and, with ``seed``, offers the tensors as its initial values.

        The first Init a shard gets wins; every worker then pulls the same values. Without
        ``seed``, waits until another worker's Init reached every shard.

        Args:
            tensors: the model's named arrays, in its order (float16, float32 or float64).
            mode: sync, async, ssp or average.
            optimizer: the server-side optimizer, or one per group (see ``groups``).
            groups: each key's optimizer group (default 0).
            staleness: ssp's bound.
            sum: sync and average apply the sum of a round's pushes, not their mean.
            max_lag: async and ssp refuse pushes computed on values more than this many versions old.
            seed: offer the tensors as the initial values.

        Returns:
            Whether some shard took this worker's values.

        Raises:
            InvalidArgumentError: a bad tensor, mode or optimizer; a shard holding another job.
            ShardUnavailableError: a shard did not come up.
        """
        check_mode(mode, staleness)
        if mode in MEMBER_MODES and not self._view():
            raise InvalidArgumentError(f"{mode} mode counts the members of a view, and this client's worker is in "
                                       f"none: start a ringserve worker first (ringserve.init()).")
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        shards = len(self._links.links) if self._links.links else await self.connect()
        self.layout = partition(specs_of(items, dict(groups or {})), shards)
        optimizers = (optimizer,) if isinstance(optimizer, Optimizer) else tuple(optimizer)
        self.jobs = [Job(mode=mode, staleness=staleness, sum=sum, groups=optimizers, pieces=pieces, shard=i,
                         shards=shards, max_lag=max_lag) for i, pieces in enumerate(self.layout.shards)]
        self.mode = mode
        self.values = {key: np.array(array, copy=True) for key, array in items}
        for link, pieces in zip(self._links.links, self.layout.shards, strict=True):
            link.pieces = pieces
        if not seed:
            await self._each(self._wait_job)
            return False
        return any(await self._each(lambda ln: self._init_one(ln, 0)))

    async def _init_one(self, link: ShardLink, version: int) -> bool:
        job = self.jobs[link.index]

        async def messages() -> AsyncIterator[pb.InitMessage]:
            yield pb.InitMessage(header=pb.InitHeader(job=job.to_proto(), worker_id=self.worker_id, version=version))
            for piece in job.pieces:
                for chunk in self._chunks(piece, self._flat(piece.key)[piece.start : piece.stop].view(np.uint8)):
                    yield pb.InitMessage(chunk=chunk)

        answer = await self._links.stub(link).Init(messages(), timeout=self.config.round_timeout_s,
                                                  metadata=self._links.security.call_metadata() or None)
        assert isinstance(answer, pb.InitResponse)
        return bool(answer.accepted)

    async def _wait_job(self, link: ShardLink) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.round_timeout_s
        while True:
            info = await self._links.stub(link).Info(pb.InfoRequest(), timeout=self.config.rpc_timeout_s)
            if info.mode:
                return
            if loop.time() > deadline:
                raise NotInitializedError(f"Parameter-server shard {link.index} got no job within "
                                          f"{self.config.round_timeout_s:g} s (no worker seeded it).")
            await asyncio.sleep(0.05)

    def _flat(self, key: str) -> np.ndarray:
        return self.values[key].reshape(-1)

    def _chunks(self, piece: Piece, payload: np.ndarray) -> Iterator[pb.PieceChunk]:
        """A piece's payload in chunks, each copied once, as it is sent."""
        data = np.ascontiguousarray(payload).data.cast("B")
        size = self.config.chunk_bytes
        for offset in range(0, len(data), size):
            yield pb.PieceChunk(key=piece.key, start=piece.start, offset=offset, total_bytes=len(data),
                                data=bytes(data[offset : offset + size]))

    def _turn(self) -> asyncio.Lock:
        """One pull or push at a time: each counts this client's steps per shard, in order."""
        if self._busy is None:
            self._busy = asyncio.Lock()  # made in the loop that uses it
        return self._busy

    # -- calls, with recovery --------------------------------------------------------------

    async def _each(self, attempt: Callable[[ShardLink], Awaitable[T]]) -> list[T]:
        """Runs ``attempt`` on every shard at once (each as ``_call`` does); returns the results in
        shard order.

        The calls share a TaskGroup: the first to fail cancels the others, and they are awaited
        before its error is raised, so no call runs on (and moves a link's step) after the caller
        has the error. The error is raised as itself, not in an ExceptionGroup; those of calls that
        failed at the same time are noted on it.
        """
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._call(link, attempt), name=f"ringserve-ps-shard-{link.index}")
                         for link in self._links.links]
        except ExceptionGroup as failed:
            error = first_error(failed)
        else:
            return [task.result() for task in tasks]
        raise error  # outside the except: the group does not become its context

    async def _call(self, link: ShardLink, attempt: Callable[[ShardLink], Awaitable[T]]) -> T:
        """Runs ``attempt`` on a shard; a shard gone is waited for and asked again, one that came
        back empty is seeded again, and a refusal becomes a ringserve error."""
        started: float | None = None
        while True:
            try:
                return await attempt(link)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if is_transient(exc):  # a broken transport or a shard going away (see verdicts.py)
                    started = started if started is not None else asyncio.get_running_loop().time()
                    self.counts["retries"] += 1
                    await self._links.recover(link, exc, started)
                    continue
                if code == grpc.StatusCode.NOT_FOUND and self.jobs:
                    await self._reseed(link)
                    continue
                raise translate(exc, link) from None

    async def _reseed(self, link: ShardLink) -> None:
        taken = await self._init_one(link, link.version)
        self.counts["reseeds"] += int(taken)
        if taken:
            link.pulled = False

    @staticmethod
    def _answered(link: ShardLink, sent_seen: int, incarnation: int) -> None:
        """A shard answered: the version seen of its earlier incarnation, if sent, has been told;
        an answer from yet another incarnation makes it a restart."""
        if sent_seen and link.seen_before == sent_seen:
            link.seen_before = 0
        if incarnation != link.incarnation:
            link.restarted(incarnation)

    # -- pull ------------------------------------------------------------------------------

    async def pull(self, *, lookahead: int = 0) -> dict[str, np.ndarray]:
        """Pulls from every shard into ``values`` (as the mode allows: see the module) and returns it.

        ``lookahead`` (ssp): the values will be used that many steps after the next one (a worker
        that computes while its previous round is in flight), and the wait for the slowest worker
        is as much longer, so the staleness bound holds for the step that uses them.

        Raises:
            CollectiveTimeoutError: a round or the slowest worker did not come within round_timeout_s.
            ShardUnavailableError: a shard did not come back within shard_wait_s.
        """
        if self.layout is None:
            raise NotInitializedError("Call init() before pull().")
        async with self._turn():
            await self._each(lambda ln: self._pull_one(ln, lookahead))
            if self.mode == "ssp":  # one clock for every shard: the furthest (see the module)
                clock = max(link.step for link in self._links.links)
                for link in self._links.links:
                    link.step = clock
        return self.values

    async def _pull_one(self, link: ShardLink, lookahead: int = 0) -> None:
        request = pb.PullRequest(worker_id=self.worker_id, view_id=self._view(), seen_version=link.seen_before)
        if self.mode in ROUND_MODES:
            request.min_version = link.step
        elif self.mode == "ssp":
            request.clock = link.step + lookahead
            request.next_step = link.step
        if link.pulled:
            request.since_version = link.version
        header: pb.PullHeader | None = None
        async for message in self._links.stub(link).Pull(request, timeout=self.config.round_timeout_s):
            if header is None:
                header = message.header
                if link.pulled and header.incarnation != link.incarnation:
                    link.restarted(header.incarnation)  # changes since a version of another incarnation mean nothing
                    return await self._pull_one(link, lookahead)
                continue
            chunk = message.chunk
            self.counts["bytes_received"] += len(chunk.data)
            target = self._flat(chunk.key).view(np.uint8)
            at = chunk.start * self.values[chunk.key].itemsize + chunk.offset
            target[at : at + len(chunk.data)] = np.frombuffer(chunk.data, dtype=np.uint8)
        assert header is not None, "a pull answers with a header first"
        self._answered(link, request.seen_version, header.incarnation)
        link.version, link.pulled = header.version, True
        link.lost_now = header.lost_updates
        if self.mode in ROUND_MODES:
            link.step = header.version
        elif self.mode == "ssp":
            link.step = max(link.step, header.clock)

    # -- push ------------------------------------------------------------------------------

    async def push(self, grads: Mapping[str, np.ndarray], *, lrs: Sequence[float] | None = None) -> list[str]:
        """Pushes this step's gradients to every shard at once; returns each shard's outcome
        (applied, accepted, duplicate or stale; see rules.py).

        Raises:
            InvalidArgumentError: a key that is not the job's; a shard refusing a shape or dtype.
            ShardUnavailableError: a shard did not come back within shard_wait_s.
        """
        return await self._push(grads, pb.GRADIENT, lrs)

    async def push_delta(self, local: Mapping[str, np.ndarray], *, lrs: Sequence[float] | None = None) -> list[str]:
        """average mode: pushes ``local - values`` (the change since the last pull) of each key."""
        deltas = {key: np.asarray(array) - self.values[key] for key, array in local.items()}
        return await self._push(deltas, pb.DELTA, lrs)

    async def _push(self, grads: Mapping[str, np.ndarray], kind: pb.PushKind, lrs: Sequence[float] | None) -> list[str]:
        if self.layout is None:
            raise NotInitializedError("Call init() before push().")
        unknown = [key for key in grads if key not in self.values]
        if unknown:
            raise InvalidArgumentError(f"The push names {unknown[0]!r}, which is not a tensor of the job "
                                       f"(its keys: {', '.join(repr(k) for k in list(self.values)[:8])}).")
        arrays = {key: np.asarray(g) for key, g in grads.items()}
        async with self._turn():
            return await self._each(lambda ln: self._push_one(ln, arrays, kind, lrs or ()))

    async def _push_one(self, link: ShardLink, grads: Mapping[str, np.ndarray], kind: pb.PushKind, lrs: Sequence[float]) -> str:
        pieces = [p for p in link.pieces if p.key in grads]
        specs = []
        for piece in pieces:
            spec = piece_proto(piece)
            grad = grads[piece.key]
            del spec.shape[:]
            spec.shape.extend(grad.shape)
            spec.dtype = grad.dtype.name
            specs.append(spec)
        header = pb.PushHeader(worker_id=self.worker_id, step=link.step, base_version=link.version,
                               view_id=self._view(), codec=self._codec.code if self._codec else peer_pb2.CODEC_NONE,
                               kind=kind, group_lrs=list(lrs), seen_version=link.seen_before, pieces=specs)

        async def messages() -> AsyncIterator[pb.PushMessage]:
            yield pb.PushMessage(header=header)
            for piece in pieces:
                flat = grads[piece.key].reshape(-1)[piece.start : piece.stop]
                payload = self._codec.encode(flat) if self._codec is not None else flat
                for chunk in self._chunks(piece, payload):
                    self.counts["bytes_sent"] += len(chunk.data)
                    yield pb.PushMessage(chunk=chunk)

        answer = await self._links.stub(link).Push(messages(), timeout=self.config.round_timeout_s,
                                                  metadata=self._links.security.call_metadata() or None)
        assert isinstance(answer, pb.PushResponse)
        self._answered(link, header.seen_version, answer.incarnation)
        outcome = OUTCOMES[answer.outcome]
        self.counts[f"pushes_{outcome}"] += 1
        if outcome != "stale" or self.mode == "async":
            link.step += 1
        elif self.mode in ROUND_MODES:
            link.step = answer.version  # the next pull returns the round in progress at once
        return outcome
