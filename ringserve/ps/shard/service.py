"""The parameter server's servicer: Init, Pull, Push and Info over one shard's store and ledger.

A thin adapter: protos in, the ledger's decisions (rules.py) carried out on the store (store.py),
protos out, and errors mapped to status codes (INVALID_ARGUMENT for bad input, naming it;
NOT_FOUND for a shard without a job (a new one, or one restarted without a checkpoint);
UNAVAILABLE while the shard is starting (it serves before the coordinator gives it its index and
before it has read its checkpoint; clients wait and ask again, as for a shard that is down);
FAILED_PRECONDITION for an Init of another job; DEADLINE_EXCEEDED for a wait that ran out), each
sent with verdicts.py's marker, which tells a client it is the shard's verdict and not gRPC's own
error for a broken transport.
The event loop stays free for the lease, pulls and Info, however large the model:

- **The arithmetic runs on a thread.** A push's decoding (and its NaN check), the optimizer's
  step and a round's mean run under ``asyncio.to_thread``; only the ledger's decision and the new
  values' installation (a reference a piece: store.py) happen on the loop.
- **One change at a time.** Decision, arithmetic and installation of a push (or a round) hold
  ``mutating``, a lock the checkpoint's snapshot takes too, so updates happen in the ledger's
  order and no pull or snapshot sees half of one. The work runs to its end even when the push's
  caller goes away (a task, shielded): a step taken is always recorded.
- **A byte budget** (``max_push_bytes``, ``Budget``): the payloads of pushes and Inits in flight,
  read into one buffer each as their chunks arrive, and a codec's decoded values, are counted
  before a byte is read; past it a push waits for room, at most max_wait_s, then fails with
  RESOURCE_EXHAUSTED naming the budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
import numpy as np

from ringserve._proto import ps_pb2 as pb
from ringserve._proto import ps_pb2_grpc as pb_grpc
from ringserve.codecs import CODECS, Codec
from ringserve.config import ShardConfig
from ringserve.errors import InvalidArgumentError
from ringserve.ps import rules
from ringserve.ps.jobs import Job, PieceId
from ringserve.ps.shard.store import Store, decode_init
from ringserve.ps.verdicts import refuse

log = logging.getLogger("ringserve.ps")

CODECS_BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values() if c is not None}


class BudgetExhausted(Exception):
    """A push or Init found no room in the byte budget within its wait."""


class Budget:
    """The bytes that pushes and Inits in flight hold together (``max_push_bytes``): each takes its
    share before it reads a byte and gives it back when done. One larger than the whole budget
    waits for the others to end, then runs alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0  # the most held at once (Info, tests)
        self._room = asyncio.Event()

    async def take(self, nbytes: int, wait_s: float) -> None:
        """Takes ``nbytes``, waiting at most ``wait_s`` for room.

        Raises:
            BudgetExhausted: no room within ``wait_s``.
        """
        try:
            async with asyncio.timeout(wait_s):
                while self.held and self.held + nbytes > self.limit:
                    self._room.clear()
                    await self._room.wait()
        except TimeoutError:
            raise BudgetExhausted(f"{nbytes} bytes found no room in {wait_s:g} s: {self.held} of the "
                                  f"{self.limit} bytes of max_push_bytes are held by pushes in flight") from None
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def give(self, nbytes: int) -> None:
        self.held -= nbytes
        self._room.set()


class ShardService(pb_grpc.ParameterServerServicer):
    """One shard's state and RPCs. The shard (node.py) sets its index and incarnation, feeds it
    views, and is told of each update through ``on_update`` (to checkpoint)."""

    def __init__(self, config: ShardConfig, *, on_update: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.index = config.shard_index
        self.shards = config.shards
        self.incarnation = 0
        self.store: Store | None = None
        self.ledger: rules.Ledger | None = None
        self._view: tuple[int, frozenset[str]] = (0, frozenset())
        self._changed = asyncio.Event()
        self._on_update = on_update
        self.mutating = asyncio.Lock()  # one change of the store at a time; the snapshot takes it too
        self.budget = Budget(config.max_push_bytes)
        self._rounds: set[asyncio.Task[None]] = set()  # rounds ended by a view or an adoption
        self.counts = {"pushes_applied": 0, "pushes_duplicate": 0, "pushes_stale": 0, "pushes_refused": 0,
                       "bytes_received": 0, "bytes_sent": 0}
        self.checkpoint_version = 0
        self.checkpoint_failures = 0  # checkpoints that could not be written (node.py)
        self.checkpoint_error = ""  # why the last one failed, while none has succeeded since
        # Set by the shard from before it serves until it holds its index and its checkpoint: any
        # answer before then would name the wrong shard, or no job where one is about to be restored.
        self.starting = False

    # -- state changes ---------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def adopt(self, store: Store, ledger: rules.Ledger) -> None:
        """Serves from a store and ledger (a fresh Init's, or a checkpoint's)."""
        self.store, self.ledger = store, ledger
        ledger.install_view(*self._view)
        self._finish_rounds_soon()
        self._notify()

    def install_view(self, view_id: int, members: frozenset[str]) -> None:
        """A view from the coordinator: members that left stop counting; a round they held up ends."""
        if view_id <= self._view[0]:
            return
        self._view = (view_id, members)
        if self.ledger is not None and self.ledger.install_view(view_id, members):
            self._finish_rounds_soon()
        self._notify()

    def _finish_rounds_soon(self) -> None:
        """Ends a round that is complete now, as its own change (a task: the callers are not async)."""
        ledger = self.ledger
        if ledger is None or not ledger.round_complete():
            return

        async def finish() -> None:
            async with self.mutating:
                await self._finish_rounds()

        task = asyncio.get_running_loop().create_task(finish(), name="ringserve-shard-round")
        self._rounds.add(task)
        task.add_done_callback(self._round_done)

    def _round_done(self, task: asyncio.Task[None]) -> None:
        self._rounds.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("shard %d: ending a round failed: %r", self.index, task.exception(), exc_info=task.exception())

    async def _finish_rounds(self) -> None:
        """With ``mutating`` held: the round's mean stepped on a thread, installed, recorded."""
        ledger, store = self.ledger, self.store
        if ledger is not None and store is not None and ledger.round_complete():
            new = await asyncio.to_thread(store.round_stepped)
            store.install(new, ledger.version + 1)
            store.next_round()
            ledger.finish_round()
            self._on_update()
            self._notify()

    async def _wait(self, ready: Callable[[], bool], context: grpc.aio.ServicerContext, waiting_for: Callable[[], str]) -> None:
        remaining = context.time_remaining()
        budget = self.config.max_wait_s if remaining is None else min(remaining, self.config.max_wait_s)
        try:
            async with asyncio.timeout(budget):
                while not ready():
                    await self._changed.wait()
        except TimeoutError:
            await refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"Shard {self.index} waited {budget:.1f} s for {waiting_for()}.")

    def held(self) -> tuple[Store, rules.Ledger] | None:
        if self.store is None or self.ledger is None:
            return None
        return self.store, self.ledger

    async def _open(self, context: grpc.aio.ServicerContext) -> None:
        if self.starting:
            await refuse(context, grpc.StatusCode.UNAVAILABLE,
                         f"This shard (of {self.shards}) is starting: it does not yet hold its index and state.")

    async def _no_job(self, context: grpc.aio.ServicerContext) -> NoReturn:
        await refuse(context, grpc.StatusCode.NOT_FOUND,
                     f"Shard {self.index} of {self.shards} holds no job yet: Init it first.")

    async def _invalid(self, context: grpc.aio.ServicerContext, exc: InvalidArgumentError | str) -> NoReturn:
        self.counts["pushes_refused"] += 1
        await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _stalled(self, context: grpc.aio.ServicerContext) -> NoReturn:
        await refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"Shard {self.index}: the stream did not end within {self.config.max_wait_s:g} s (max_wait_s).")

    def _seen(self, ledger: rules.Ledger, seen_version: int) -> None:
        if seen_version and ledger.note_seen(seen_version):
            log.warning(
                "shard %d of %d came back at version %d, and workers had seen version %d of its earlier "
                "incarnation: %d updates lost", self.index, self.shards, ledger.restored_version, ledger.max_seen,
                ledger.lost_updates,
            )

    # -- RPCs ------------------------------------------------------------------------------

    async def Init(self, request_iterator: AsyncIterator[pb.InitMessage], context: grpc.aio.ServicerContext) -> pb.InitResponse:
        await self._open(context)
        stream = aiter(request_iterator)
        first = await anext(stream, None)
        if first is None or not first.HasField("header"):
            await self._invalid(context, "An Init starts with its header.")
        header = first.header
        try:
            job = Job.from_proto(header.job)
        except InvalidArgumentError as exc:
            await self._invalid(context, exc)
        if (job.shard, job.shards) != (self.index, self.shards):
            await self._invalid(context, f"This is shard {self.index} of {self.shards}; the Init is for shard "
                                         f"{job.shard} of {job.shards}.")
        held = self.held()
        if held is not None:
            return await self._keep(held[0], held[1], job, context)
        nbytes = sum(p.nbytes for p in job.pieces)
        if nbytes > self.config.max_shard_bytes:
            await refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"The Init's {nbytes} bytes pass shard {self.index}'s cap of {self.config.max_shard_bytes} "
                         f"(max_shard_bytes).")
        sizes = {p.id: p.nbytes for p in job.pieces}
        await self._take(nbytes, "Init", context)
        try:
            try:
                payloads = await self._read(stream, sizes, context)
                values = await asyncio.to_thread(decode_init, job, payloads.items())
            except InvalidArgumentError as exc:
                await self._invalid(context, exc)
            except TimeoutError:
                await self._stalled(context)
        finally:
            self.budget.give(nbytes)  # the values are the store's from here, bounded by max_shard_bytes
        held = self.held()
        if held is not None:  # another Init finished while this one streamed
            return await self._keep(held[0], held[1], job, context)
        version = header.version
        self.adopt(Store(job, values, version),
                   rules.Ledger(job.mode, job.staleness, job.max_lag, version=version, restored_version=version))
        log.info("shard %d of %d: %s job of %d pieces (%d bytes) from worker %s at version %d", self.index,
                 self.shards, job.mode, len(job.pieces), nbytes, header.worker_id, version)
        return pb.InitResponse(accepted=True, version=version)

    async def _keep(self, store: Store, ledger: rules.Ledger, job: Job, context: grpc.aio.ServicerContext) -> pb.InitResponse:
        difference = store.job.difference(job)
        if difference:
            await refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                         f"Shard {self.index} holds another job: {difference}.")
        return pb.InitResponse(accepted=False, version=ledger.version)

    async def _read(self, stream: AsyncIterator[pb.InitMessage] | AsyncIterator[pb.PushMessage],
                    sizes: dict[PieceId, int], context: grpc.aio.ServicerContext) -> dict[PieceId, np.ndarray]:
        """Reads the chunks that follow a header into one buffer per piece, each exactly its size
        and made at its first chunk (the budget counted it already), handed on without a copy.

        Raises:
            InvalidArgumentError: a chunk of a piece not named, out of order, or past its size; a
                piece cut short.
            TimeoutError: the stream did not end within max_wait_s.
        """
        buffers: dict[PieceId, np.ndarray] = {}
        views: dict[PieceId, memoryview] = {}
        received: dict[PieceId, int] = {}
        async with asyncio.timeout(self.config.max_wait_s):
            async for message in stream:
                if not message.HasField("chunk"):
                    raise InvalidArgumentError("A header may come only first.")
                chunk = message.chunk
                pid = (chunk.key, chunk.start)
                size = sizes.get(pid)
                if size is None:
                    raise InvalidArgumentError(f"A chunk of {chunk.key!r} from element {chunk.start} is not of a piece "
                                               f"the header named.")
                got = received.get(pid, 0)
                if chunk.offset != got or chunk.total_bytes != size or got + len(chunk.data) > size:
                    raise InvalidArgumentError(
                        f"A chunk of {chunk.key!r}[{chunk.start}:] at byte {chunk.offset} ({len(chunk.data)} bytes of "
                        f"{chunk.total_bytes}) does not follow the {got} bytes received of its {size}."
                    )
                view = views.get(pid)
                if view is None:
                    # Uninitialised: its pages are mapped as chunks fill them. A bytearray is zeroed
                    # whole here, on the loop: 0.2-0.5 s for a 1 GiB piece (the loop's worst lag).
                    buffers[pid] = np.empty(size, dtype=np.uint8)
                    view = views[pid] = buffers[pid].data
                view[got : got + len(chunk.data)] = chunk.data
                received[pid] = got + len(chunk.data)
        short = [f"{k!r}[{s}:] ({received.get((k, s), 0)} of {n} bytes)" for (k, s), n in sizes.items()
                 if received.get((k, s), 0) != n]
        if short:
            raise InvalidArgumentError(f"The stream ended before the whole of {short[0]}.")
        self.counts["bytes_received"] += sum(sizes.values())
        return buffers

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PullMessage]:
        await self._open(context)
        held = self.held()
        if held is None:
            await self._no_job(context)
        store, ledger = held
        self._seen(ledger, request.seen_version)
        if request.next_step and ledger.note_clock(request.worker_id, request.next_step):
            self._notify()  # the slowest member may be faster now: waiting pulls look again

        def ready() -> bool:
            return ledger.pull_ready(min_version=request.min_version, clock=request.clock)

        def waiting_for() -> str:
            if ledger.version < request.min_version:
                return (f"version {request.min_version} (it holds {ledger.version}; the round waits for "
                        f"{', '.join(ledger.missing()) or 'no member'})")
            return (f"the slowest member to reach step {request.clock - ledger.staleness} (it is at "
                    f"{ledger.min_clock()})")

        if not ready():
            await self._wait(ready, context, waiting_for)
        since = request.since_version if request.HasField("since_version") else None
        taken = [(e.piece, e.values) for e in store.changed_since(since)]
        clock = ledger.start_clock(request.worker_id) if ledger.mode == "ssp" else 0
        yield pb.PullMessage(header=pb.PullHeader(version=ledger.version, pieces=len(taken),
                                                  lost_updates=ledger.lost_updates, clock=clock,
                                                  incarnation=self.incarnation))
        chunk = self.config.chunk_bytes
        for piece, values in taken:
            data = values.data.cast("B")
            total = len(data)
            for offset in range(0, total, chunk):
                part = data[offset : offset + chunk]
                self.counts["bytes_sent"] += len(part)
                yield pb.PullMessage(chunk=pb.PieceChunk(key=piece.key, start=piece.start, offset=offset,
                                                         total_bytes=total, data=bytes(part)))

    async def Push(self, request_iterator: AsyncIterator[pb.PushMessage], context: grpc.aio.ServicerContext) -> pb.PushResponse:
        await self._open(context)
        stream = aiter(request_iterator)
        first = await anext(stream, None)
        if first is None or not first.HasField("header"):
            await self._invalid(context, "A push starts with its header.")
        header = first.header
        held = self.held()
        if held is None:
            await self._no_job(context)
        store, ledger = held
        self._seen(ledger, header.seen_version)
        codec: Codec | None = None
        if header.codec:
            found = CODECS_BY_CODE.get(header.codec)
            if found is None:
                await self._invalid(context, f"The push's codec {header.codec} is not one of {sorted(CODECS_BY_CODE)}.")
            codec = found
        try:
            sizes = store.check_push(header.pieces, codec, header.kind, header.group_lrs)
        except InvalidArgumentError as exc:
            await self._invalid(context, exc)
        early = self._decide(ledger, header)
        if early.outcome in (rules.DUPLICATE, rules.STALE):
            return self._answer(early, ledger)  # the payload is not needed
        need = sum(sizes.values()) + (4 * sum(store.entries[pid].piece.count for pid in sizes) if codec else 0)
        await self._take(need, "push", context)
        committing: asyncio.Future[rules.Decision | None] | None = None
        try:
            try:
                payloads = await self._read(stream, sizes, context)
                grads = await asyncio.to_thread(self._decoded, store, payloads, codec)
            except InvalidArgumentError as exc:
                await self._invalid(context, exc)
            except TimeoutError:
                await self._stalled(context)
            while True:
                if self._decide(ledger, header).outcome == rules.WAIT:
                    await self._wait(lambda: self._decide(ledger, header).outcome != rules.WAIT, context,
                                     lambda: f"view {header.view_id} (it knows view {ledger.view_id})")
                # To its end even if this call is cancelled: a step taken is recorded (and the
                # budget given back when it is done, below).
                committing = asyncio.ensure_future(self._commit(store, ledger, header, grads))
                decision = await asyncio.shield(committing)
                if decision is not None:
                    break
                committing = None  # the view moved on while it waited for the lock: wait again
        finally:
            if committing is None or committing.done():
                self.budget.give(need)
            else:
                committing.add_done_callback(lambda _: self.budget.give(need))
        return self._answer(decision, ledger)

    async def _take(self, nbytes: int, what: str, context: grpc.aio.ServicerContext) -> None:
        """Takes the byte budget for a push or an Init, or refuses it with RESOURCE_EXHAUSTED."""
        try:
            await self.budget.take(nbytes, self.config.max_wait_s)
        except BudgetExhausted as exc:
            await refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"Shard {self.index}: the {what}'s {exc}.")

    @staticmethod
    def _decoded(store: Store, payloads: dict[PieceId, np.ndarray], codec: Codec | None) -> dict[PieceId, np.ndarray]:
        """A push's pieces as values, checked for NaN and Inf (on a thread)."""
        return {pid: store.decode(pid, data, codec) for pid, data in payloads.items()}

    async def _commit(self, store: Store, ledger: rules.Ledger, header: pb.PushHeader,
                      grads: dict[PieceId, np.ndarray]) -> rules.Decision | None:
        """With ``mutating``: the push decided again and carried out, the arithmetic on a thread;
        None if it must wait for a view first."""
        async with self.mutating:
            decision = self._decide(ledger, header)
            if decision.outcome == rules.WAIT:
                return None
            if decision.outcome == rules.APPLY:
                new = await asyncio.to_thread(store.stepped, grads, header.group_lrs)
                store.install(new, ledger.version + 1)
                ledger.record(decision, header.worker_id, header.step)
                self.counts["pushes_applied"] += 1
                self._on_update()
            elif decision.outcome == rules.ACCEPT:
                skipped = decision.skip_to - ledger.version if decision.skip_to >= 0 else 0
                ledger.record(decision, header.worker_id, header.step)
                self.counts["pushes_applied"] += 1
                if skipped:
                    log.warning("shard %d of %d: worker %s pushes round %d, %d rounds past the %d it holds: "
                                "those rounds' updates are lost", self.index, self.shards, header.worker_id,
                                header.step, skipped, header.step - skipped)
                await asyncio.to_thread(store.accumulate, grads, header.group_lrs)
                before = ledger.version
                await self._finish_rounds()
                if ledger.version > before:
                    decision = rules.Decision(rules.APPLY)
            self._notify()
            return decision

    def _decide(self, ledger: rules.Ledger, header: pb.PushHeader) -> rules.Decision:
        return ledger.decide_push(header.worker_id, step=header.step, base_version=header.base_version,
                                  view_id=header.view_id)

    def _answer(self, decision: rules.Decision, ledger: rules.Ledger) -> pb.PushResponse:
        outcome = {rules.APPLY: pb.APPLIED, rules.ACCEPT: pb.ACCEPTED, rules.DUPLICATE: pb.DUPLICATE,
                   rules.STALE: pb.STALE}[decision.outcome]
        if outcome == pb.DUPLICATE:
            self.counts["pushes_duplicate"] += 1
        elif outcome == pb.STALE:
            self.counts["pushes_stale"] += 1
        return pb.PushResponse(outcome=outcome, version=ledger.version, detail=decision.detail,
                               incarnation=self.incarnation)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        await self._open(context)
        answer = pb.InfoResponse(shard=max(self.index, 0), shards=self.shards, view_id=self._view[0],
                                 checkpoint_version=self.checkpoint_version, cpu_s=time.process_time(),
                                 checkpoint_failures=self.checkpoint_failures, checkpoint_error=self.checkpoint_error)
        for name, count in self.counts.items():
            setattr(answer, name, count)
        held = self.held()
        if held is not None:
            store, ledger = held
            answer.mode = ledger.mode
            answer.version = ledger.version
            answer.pieces = len(store.entries)
            answer.bytes = store.nbytes
            answer.lost_updates = ledger.lost_updates
            answer.restored_version = ledger.restored_version
            answer.round_pushes = store.round_pushes
            answer.members.extend(sorted(ledger.members))
            answer.clocks.extend(pb.WorkerClock(worker_id=w, clock=ledger.clock(w)) for w in sorted(ledger.members))
        return answer
