"""Thin grpc.aio servicer over the coordinator's domain: protos in, domain calls, protos out.

The decisions live in pure modules beside it: membership.py (the state machine, whose actions
``apply`` carries out), ledger.py (the job's commit mark), stalls.py (the stall inspector),
params.py (the parameter store and one put's chunks), watches.py (the caps on WatchView streams)
and pacing.py. Here each RPC turns its request into calls on them, and their errors into status
codes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from ringserve import commits
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.config import CoordinatorConfig
from ringserve.constants import SWEEP_S
from ringserve.coordinator import membership, pacing
from ringserve.coordinator.beats import HeartbeatStreams
from ringserve.coordinator.board import Board
from ringserve.coordinator.directory import Directory, NoFreeShardError, ShardIndexTakenError
from ringserve.coordinator.ledger import CommitLedger
from ringserve.coordinator.params import ParamsFullError, ParamsInvalidError, ParamStore, Upload
from ringserve.coordinator.probes import Prober
from ringserve.coordinator.stalls import StallInspector
from ringserve.coordinator.views import EncodedView
from ringserve.coordinator.watches import WatchCaps, WatchRefusedError
from ringserve.errors import InvalidArgumentError
from ringserve.security import Security

log = logging.getLogger("ringserve.coordinator")

# Ticks further apart than STALL_TICKS ticks (and STALL_MIN_S) mean the coordinator's loop did not
# run: membership does not count that silence against the workers (silence.forgive_stall). A
# loaded machine delays a tick by tens of milliseconds; a second is a stall.
STALL_TICKS = 10
STALL_MIN_S = 1.0
PARAM_CHUNK_BYTES = 1 << 20
# The longest gang name a join may give (JoinRequest.gang).
MAX_GANG_NAME = 256
# Puts whose chunks are read at once; the others wait their turn unread (HTTP/2 flow control holds
# their data back at the client). Thirty-two puts read at once kept the loop 0.8 s at a time from
# heartbeats, and 200 members were declared dead.
PUTS_AT_ONCE = 2
# A put being read that sends nothing for this long is ended, so that two stalled clients cannot
# hold every put back.
PUT_STALL_S = 10.0
# Claimed view numbers above this are refused; the world can then still number 2**32 more views.
MAX_VIEW_ID = (1 << 64) - (1 << 32)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """Owns the membership state; every change goes through ``membership.step``."""

    def __init__(
        self, config: CoordinatorConfig, clock: Callable[[], float] = time.monotonic, *, security: Security | None = None
    ) -> None:
        self._config = config
        # The probe of a suspect worker dials its peer server, with the job's TLS and token.
        self._security = security or Security.load(config)
        self._clock = clock
        self._started = clock()
        rules = membership.Rules(
            min_workers=config.min_workers,
            max_workers=config.max_workers,
            settle_s=config.settle_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            failure_window_s=pacing.failure_window(config.heartbeat_interval_s, config.heartbeat_timeout_s),
            heartbeat_interval_s=config.heartbeat_interval_s,
            max_heartbeats_per_s=config.max_heartbeats_per_s,
            stall_s=max(STALL_MIN_S, STALL_TICKS * config.tick_s),
            silence_grace_s=config.heartbeat_grace_s,
            sweep_s=SWEEP_S,
        )
        self._state = membership.State(rules=rules)
        self._watchers: set[asyncio.Queue[bytes]] = set()
        self.watches = WatchCaps(config.watch_stream_cap, config.max_watches_per_worker)
        self.heartbeat_streams = HeartbeatStreams(config.heartbeat_stream_cap, config.heartbeat_timeout_s)
        self._encoded = EncodedView(self._state.view)
        # Workers waiting to be admitted, recomputed only when the workers or the view change
        # (not on each of 2,000 heartbeats a second): the tables it was counted from, and the count.
        self._waiting: tuple[tuple[object, ...] | None, int] = (None, 0)
        self._counters: dict[str, pb.WorkerCounters] = {}
        self.params = ParamStore(config.max_param_bytes)
        self._puts = asyncio.Semaphore(PUTS_AT_ONCE)
        self.views_formed = 0
        # Suspects' health is asked on the side; each answer comes back as a ProbeResult event.
        self.prober = Prober(self._security, config.heartbeat_timeout_s, self.apply)
        self.counts = {"workers_removed_silent": 0, "workers_left": 0, "heartbeats": 0, "stall_warnings": 0}
        self.stalls = StallInspector()
        self.view_changed = asyncio.Event()
        # The job's committed high-water mark, from the workers' heartbeats (see ledger.py).
        self.ledger = CommitLedger()
        self.board = Board(self._started)  # the history and commits the status page shows (board.py)
        # The parameter-server shards' directory (see directory.py): leases of a heartbeat timeout.
        self.shards = Directory(lease_s=config.heartbeat_timeout_s)

    @property
    def view(self) -> membership.ViewInfo:
        return self._state.view

    @property
    def joins(self) -> int:
        """Workers that have joined since this coordinator started (a rejoin under its id is not counted)."""
        return self._state.join_seq

    @property
    def mark(self) -> commits.Mark:
        """The job's committed high-water mark (see ledger.py)."""
        return self.ledger.mark

    @property
    def watch_streams(self) -> int:
        """The WatchView streams open now."""
        return self.watches.open

    def _encode(self) -> EncodedView:
        if self._encoded.view is not self._state.view:
            self._encoded = EncodedView(self._state.view)
        return self._encoded

    def _admissible(self) -> int:
        """membership.admissible, counted again only when a table it reads has changed (a heartbeat
        must not cost work proportional to the number of workers)."""
        state = self._state
        tables, count = self._waiting
        now = (state.workers, state.view, state.held, state.preparing)
        if tables is None or any(a is not b for a, b in zip(tables, now, strict=True)):
            count = membership.admissible(state)
            self._waiting = (now, count)
        return count

    def apply(self, event: membership.Event) -> None:
        """Feeds one event to the state machine and carries out its actions."""
        before, now = self._state, self._clock()
        self._state, actions = membership.step(before, event, now)
        self.board.applied(before, event, self._state, actions, now)
        for action in actions:
            if isinstance(action, membership.PublishView):
                self.views_formed += 1
                self.ledger.view_published(action.view)
                log.info("view %d formed with %d workers", action.view.view_id, len(action.view.members))
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("view %d: %s", action.view.view_id, [m.address for m in action.view.members])
                # Encoded once, here; every watcher's queue holds the same bytes.
                data = EncodedView(action.view).data if action.view is not self._state.view else self._encode().data
                for queue in self._watchers:
                    queue.put_nowait(data)
                self.view_changed.set()
                self.view_changed = asyncio.Event()
            elif isinstance(action, membership.Probe):
                self.prober.start(action)
            elif isinstance(action, membership.Removed):
                log.info("worker %s removed: %s", action.worker_id, action.reason)
                self.counts["workers_left" if action.reason == "left" else "workers_removed_silent"] += 1
                self.stalls.forget(action.worker_id)
                self._counters.pop(action.worker_id, None)

    async def close(self) -> None:
        """Cancels the probes in flight."""
        await self.prober.close()

    def metrics(self) -> dict[str, float]:
        """The numbers the coordinator's Prometheus endpoint exposes."""
        return {
            **self.counts,
            "views_formed": self.views_formed,
            "view": self._state.view.view_id,
            "view_size": len(self._state.view.members),
            "workers_waiting": membership.waiting(self._state),
            "workers_preparing": len(self._state.preparing),
            "watch_streams": self.watch_streams,
            "heartbeat_streams": self.heartbeat_streams.open,
            "param_bytes": self.params.stored_bytes + self.params.streaming_bytes,
            "committed_step": self.mark.commit.step if self.mark.commit is not None else -1,
            "committed_lineage": self.mark.commit.lineage if self.mark.commit is not None else 0,
        }

    # -- RPCs --------------------------------------------------------------------------------

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        worker_id = request.worker_id or uuid.uuid4().hex
        claim = None
        if request.view_id and request.view_size:
            if request.view_id >= MAX_VIEW_ID:
                # Views are numbered on from a claim: leave room so that numbers stay uint64.
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"A rejoin claims view {request.view_id}; view numbers stop at {MAX_VIEW_ID - 1}.",
                )
            if not request.rank < request.view_size <= self._config.max_workers:
                # Checked here, not trusted: recovery walks every rank of a claimed view.
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"A rejoin claims rank {request.rank} of a view of {request.view_size} workers; the rank "
                    f"must be below the size, and the size at most max_workers ({self._config.max_workers}).",
                )
            claim = membership.Claim(request.view_id, request.rank, request.view_size)
        if bool(request.gang) != (request.gang_size > 0) or request.gang_size > self._config.max_workers \
                or len(request.gang) > MAX_GANG_NAME:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"A join names gang {request.gang[:MAX_GANG_NAME]!r} of {request.gang_size} workers; a gang needs a "
                f"name of at most {MAX_GANG_NAME} characters and a size from 1 to max_workers "
                f"({self._config.max_workers}), or neither.",
            )
        self.apply(membership.Join(worker_id, request.address, request.hostname, request.rank_hint, claim,
                                   prepare=request.prepare, gang=request.gang, gang_size=request.gang_size))
        answer = pb.JoinResponse(
            worker_id=worker_id,
            heartbeat_interval_s=membership.heartbeat_interval(self._state),
            heartbeat_timeout_s=self._config.heartbeat_timeout_s,
        )
        if worker_id in self._state.preparing:
            answer.preparing = True
            (answer.provisional_rank, answer.provisional_size, answer.provisional_local_rank,
             answer.provisional_local_size) = membership.provisional(self._state, worker_id)
        return answer

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        self.apply(membership.Leave(request.worker_id))
        return pb.LeaveResponse()

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        return self._beat(request)

    async def Heartbeats(self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext) -> None:
        """Heartbeat on one long-lived stream, each request answered in order (see beats.py)."""
        await self.heartbeat_streams.serve(context, self._beat)

    def _beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """A heartbeat's effect and its answer, on a unary call or a stream."""
        known = membership.is_known(self._state, request.worker_id)
        warnings: list[str] = []
        if known:
            self.counts["heartbeats"] += 1
            self.apply(membership.Heartbeat(request.worker_id))
            if request.ready and request.worker_id in self._state.preparing:
                log.info("worker %s is ready to join", request.worker_id)
                self.apply(membership.Ready(request.worker_id))
            self._counters[request.worker_id] = request.counters
            stalled = frozenset(request.stalled)
            self.stalls.heard(request.worker_id, request.view_id, stalled)
            warnings, new = self.stalls.warnings(self._state.view, request.view_id, stalled)
            for text in new:
                self.counts["stall_warnings"] += 1
                log.warning("view %d: stalled collective %s", request.view_id, text)
            if request.linked_view and membership.checking(self._state):
                self.apply(membership.Linked(request.worker_id, request.linked_view))
            if request.HasField("committed_step"):
                self._record_commit(request)
            self.board.beat(request.worker_id, request, self.mark, self._clock())
        answer = pb.HeartbeatResponse(
            view_id=self._state.view.view_id, known=known, pending_workers=self._admissible(),
            stall_warnings=warnings, heartbeat_interval_s=membership.heartbeat_interval(self._state),
        )
        if self.mark.commit is not None:
            answer.mark_step, answer.mark_lineage = self.mark.commit.step, self.mark.commit.lineage
        return answer

    def _record_commit(self, request: pb.HeartbeatRequest) -> None:
        member = self._state.workers.get(request.worker_id)
        before, after = self.ledger.record(
            worker_id=request.worker_id, address=member.address if member else "", view_id=request.view_id,
            held=commits.Commit(request.committed_lineage, request.committed_step), made_in=request.committed_view,
        )
        if before is not None and after is not None and after.lineage > before.lineage:
            log.warning("the job resumed at %s after losing %s", after, before)

    async def WatchView(self, request: pb.WatchViewRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Yields views already encoded (see ``view_bytes``), within the caps on streams."""
        worker_id = request.worker_id
        try:
            self.watches.admit(worker_id)
        except WatchRefusedError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            if self._state.view.view_id:
                yield self._encode().data
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)
            last = self.watches.release(worker_id)
            if last and membership.is_known(self._state, worker_id) and self._state.view.rank_of(worker_id) is None:
                # A worker waiting to be admitted whose last watch ended is gone (a SIGTERM before
                # its elastic loop handles one, a kill), or it watches again, hears it is unknown
                # and rejoins: dropped now, no commit admits a dead process into its members' sync.
                self.apply(membership.Leave(worker_id))

    async def ReportFailure(self, request: pb.ReportFailureRequest, context: grpc.aio.ServicerContext) -> pb.ReportFailureResponse:
        log.warning(
            "worker %s reports rank %d of view %d: %r",
            request.reporter_id, request.suspect_rank, request.view_id, request.reason,
        )
        view = self._state.view
        reporter_known = membership.is_known(self._state, request.reporter_id)
        if reporter_known and request.view_id == view.view_id and request.suspect_rank < len(view.members):
            self.apply(membership.Suspect(view.members[request.suspect_rank].worker_id))
        return pb.ReportFailureResponse()

    async def Admit(self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext) -> pb.AdmitResponse:
        view = self._state.view
        admitted = membership.admissible(self._state)
        if request.view_id != view.view_id or view.rank_of(request.worker_id) is None:
            admitted = 0
        self.apply(membership.Admit(request.worker_id, request.view_id, tuple(request.leaving_worker_ids)))
        return pb.AdmitResponse(admitted=admitted)

    async def PutParams(self, request_iterator: AsyncIterator[pb.ParamChunk], context: grpc.aio.ServicerContext) -> pb.PutParamsResponse:
        """Stores blobs streamed in chunks (see params.Upload): each blob's declared total is
        counted against the cap from its first chunk on, so that puts at once are admitted whole
        or refused at once, instead of all growing until every one of them is refused halfway."""
        upload = Upload(self.params)
        refusal: tuple[grpc.StatusCode, str] | None = None
        version = 0
        try:
            async with self._puts:
                chunks = aiter(request_iterator)
                while (chunk := await _next_within(chunks, PUT_STALL_S)) is not None:
                    upload.add(chunk.key, chunk.offset, chunk.total_bytes, chunk.data)
            version = upload.commit()
        except TimeoutError:
            refusal = grpc.StatusCode.DEADLINE_EXCEEDED, f"The put sent nothing for {PUT_STALL_S:g} s."
        except ParamsFullError as exc:
            refusal = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except ParamsInvalidError as exc:
            refusal = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        finally:
            upload.release()
        if refusal is not None:
            # Outside the handlers, so that the abort chains no exception of ours and its frames:
            # aborted from inside them, a flood of refused puts left the coordinator's memory some
            # 5 MiB higher after it (tests/security/test_coordinator_bounds.py).
            await context.abort(*refusal)
        return pb.PutParamsResponse(version=version)

    async def GetParams(self, request: pb.GetParamsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ParamChunk]:
        data = self.params.get(request.key)
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"No parameters are stored under {request.key!r}.")
            return
        for offset in range(0, max(len(data), 1), PARAM_CHUNK_BYTES):
            yield pb.ParamChunk(
                key=request.key, offset=offset, total_bytes=len(data),
                data=data[offset : offset + PARAM_CHUNK_BYTES],
            )

    async def CommitMark(self, request: pb.CommitMarkRequest, context: grpc.aio.ServicerContext) -> pb.CommitMarkResponse:
        mark = self.mark
        if mark.commit is None:
            return pb.CommitMarkResponse(known=False)
        return pb.CommitMarkResponse(
            known=True, step=mark.commit.step, lineage=mark.commit.lineage,
            holders=[pb.CommitHolder(worker_id=h.worker_id, address=h.address, view_id=h.view_id, rank=h.rank,
                                     present=membership.is_known(self._state, h.worker_id))
                     for h in mark.holders],
        )

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return self.status(request)

    def status(self, request: pb.StatusRequest) -> pb.StatusResponse:
        """The view and the members' health: all of them by default, a page of them with
        ``offset`` and ``limit``, none with ``summary_only`` (the view then lists no members).
        The status page (http.py) reads this, and nothing else."""
        now = self._clock()
        encoded = self._encode()
        view = encoded.view
        answer = pb.StatusResponse(
            uptime_s=now - self._started,
            views_formed=self.views_formed,
            pending_workers=membership.waiting(self._state),
            min_workers=self._config.min_workers,
            max_workers=self._config.max_workers,
            view_size=len(view.members),
            heartbeat_timeout_s=self._config.heartbeat_timeout_s,
            heartbeat_interval_s=membership.heartbeat_interval(self._state),
        )
        if request.summary_only:
            answer.view.view_id = view.view_id
            answer.view.left_worker_ids.extend(view.left)
            answer.view.failed_worker_ids.extend(view.failed)
            return answer
        answer.view.CopyFrom(encoded.message)
        last_seen = membership.seen(self._state)
        stop = len(view.members) if not request.limit else request.offset + request.limit
        no_counters = pb.WorkerCounters()
        for rank in range(request.offset, min(stop, len(view.members))):
            worker_id = view.members[rank].worker_id
            answer.members.append(
                pb.MemberStatus(
                    member=encoded.message.members[rank],
                    seconds_since_heartbeat=now - last_seen.get(worker_id, now),
                    counters=self._counters.get(worker_id, no_counters),
                )
            )
        self.board.fill(answer, self.mark, self.stalls.current(view))
        return answer

    async def RegisterShard(self, request: pb.RegisterShardRequest, context: grpc.aio.ServicerContext) -> pb.RegisterShardResponse:
        """A parameter-server shard takes or refreshes its index (see directory.py)."""
        try:
            got = self.shards.register(request.shard_id, request.address, shards=request.shards,
                                       index=request.index, first=request.first, now=self._clock())
        except InvalidArgumentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (ShardIndexTakenError, NoFreeShardError) as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        if request.first:
            log.info("parameter-server shard %d of %d at %s (incarnation %d)", got.index, got.shards,
                     request.address, got.incarnation)
        return pb.RegisterShardResponse(index=got.index, shards=got.shards, incarnation=got.incarnation,
                                        refresh_s=self._config.heartbeat_interval_s,
                                        lease_s=self._config.heartbeat_timeout_s)

    async def ListShards(self, request: pb.ListShardsRequest, context: grpc.aio.ServicerContext) -> pb.ListShardsResponse:
        now = self._clock()
        return pb.ListShardsResponse(shards=self.shards.shards, entries=[
            pb.ShardEntry(index=i, address=slot.address, shard_id=slot.shard_id, incarnation=slot.incarnation,
                          alive=alive, seconds_since_seen=now - slot.seen_at)
            for i, slot, alive in self.shards.entries(now)
        ])


async def _next_within(chunks: AsyncIterator[pb.ParamChunk], stall_s: float) -> pb.ParamChunk | None:
    """The next chunk of a put (None at its end), failing with TimeoutError after ``stall_s``."""
    try:
        return await asyncio.wait_for(anext(chunks), stall_s)
    except StopAsyncIteration:
        return None
