"""How a torch process group finds its ringserve world, in the three ways a job starts.

1. **Under ``ringserve run``** (RINGSERVE_COORDINATOR is set; the launcher also exports torch's
   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so ``env://`` works): every rank
   joins the launcher's coordinator.
2. **Under ``torchrun``, or any ``env://`` / ``tcp://`` start without a coordinator**: rank 0
   starts a coordinator in its own process, on the host of torch's store (MASTER_ADDR) and a free
   port (``Options.coordinator_port`` fixes it), and publishes ``host:port`` in torch's store
   (at MASTER_ADDR:MASTER_PORT) under ``ringserve/coordinator/<torchrun's restart count>``; the
   other ranks read it there and join. So the only port a job must open besides the workers' is
   torch's own MASTER_PORT (and the coordinator's, where it is fixed). Off loopback the
   coordinator is secure by default (config.secured_job): without a token of the user's, rank 0
   makes one and publishes it in the store beside the address (``.../token``), so exactly the
   processes torch's rendezvous trusts can join.
3. **``init_method="ringserve://host:port"``**: every rank joins that coordinator; the view's
   rank 0 then starts a TCPStore for torch (on a free port, announced over the ring), since torch
   wants a store too.

In every case each rank joins with its torch rank as ringserve's rank hint, waits for the first
view, and the view must then agree with torch: the same rank and world size, or a clear error.
The worker is ringserve's default context (``ringserve.api``), which ``ringserve.torch``'s
Horovod-style functions share; the backend shuts down only a worker it started itself.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch.distributed as dist

from ringserve import api
from ringserve.config import CoordinatorConfig, secured_job
from ringserve.constants import (
    COORDINATOR_START_S,
    COORDINATOR_STOP_GRACE_S,
    COORDINATOR_STOP_WAIT_S,
    FIXED_JOB_SETTLE_S,
    POLL_S,
)
from ringserve.coordinator import Coordinator
from ringserve.errors import InvalidArgumentError, RingserveError
from ringserve.loop import LoopThread
from ringserve.torch.distributed.settings import LOOPBACK, Settings

log = logging.getLogger("ringserve.torch.distributed")

COORDINATOR_KEY = "ringserve/coordinator"
TOKEN_KEY = "token"  # under the coordinator's key: the token rank 0 made for the job (config.secured_job)
FAREWELL = "ringserve.torch.distributed.farewell"
SCHEME = "ringserve"

# The workers this module started (not those a script started with hvd.init() first): only these
# are shut down with the process group. A weak set hung on ringserve.api's one default context,
# as ringserve.torch.basics hangs its names; it holds no state of its own.
_started: weakref.WeakSet[api.Context] = weakref.WeakSet()


class LocalCoordinator:
    """A coordinator that rank 0 runs for a torchrun job, on a loop thread of its own."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self._thread = LoopThread(use_uvloop=True, name="ringserve-dist-coordinator")
        try:
            self.coordinator = self._thread.run(Coordinator(config).start(), COORDINATOR_START_S)
        except BaseException:
            self._thread.stop()
            raise
        self._stopped = False

    @property
    def port(self) -> int:
        return self.coordinator.port

    def stop(self, linger_s: float) -> None:
        """Stops it once the other workers have left (at most ``linger_s``): rank 0 is often done
        first, and the others' last heartbeats and their leave must still find it."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            known = self.coordinator.service.metrics()
            if known["view_size"] + known["workers_waiting"] == 0:
                break
            time.sleep(POLL_S)
        try:
            self._thread.run(self.coordinator.stop(COORDINATOR_STOP_GRACE_S), COORDINATOR_STOP_WAIT_S)
        finally:
            self._thread.stop()


@dataclass
class World:
    """The ringserve worker a process group runs on, and what the backend must release with it.

    ``view_id``: the view the default group was formed in (set by the group), for ``farewell``.
    """

    context: api.Context
    owned: bool
    coordinator: LocalCoordinator | None = None
    view_id: int | None = None
    _closed: bool = field(default=False, repr=False)

    def farewell(self) -> None:
        """Waits, within a collective deadline, until every rank of the group's view is leaving too.

        A worker that leaves moves the world to a new view, and every group of the old view fails
        (its members are fixed). Ranks that share no op at the end (HSDP's shard groups, two
        subgroups, a send whose recv comes later) finish at different times, so the first to be
        done must not take the others' groups down with it: it leaves once all are done, as a
        gloo rank's exit leaves the others' groups alone. Skipped once the view has moved on (a
        peer died: nobody waits for it), and a failure here only ends the wait.
        """
        worker = self.context.worker
        if self.view_id is None or worker.latest_view != self.view_id or worker.size < 2:
            return
        one = np.zeros(1, dtype=np.int32)
        try:
            self.context.call(lambda w: w.allreduce(one, op="sum", name=FAREWELL))
        except RingserveError as exc:
            log.info("%s: leaving without waiting for the others: %s", worker.tag, exc)

    def close(self) -> None:
        """Shuts down what the backend started: its worker (leaving the world, once the others are
        done: ``farewell``), then its coordinator."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self.owned and api.is_initialized() and api.context() is self.context:
                self.farewell()
                api.shutdown()
        finally:
            if self.coordinator is not None:
                self.coordinator.stop(self.context.config.drain_timeout_s)


def _store_host(store: dist.Store) -> str:
    """The host of the TCPStore under ``store`` (rank 0's, under env://, tcp:// and torchrun)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host = getattr(store, "host", "") if isinstance(store, dist.TCPStore) else ""
    return host or "127.0.0.1"


def _overrides(settings: Settings, rank: int, timeout: timedelta | None, host: str) -> dict[str, Any]:
    """WorkerConfig fields for a worker joining as torch's ``rank`` (the rest from the environment)."""
    overrides: dict[str, Any] = {}
    if rank >= 0:
        overrides["rank_hint"] = rank
    if timeout is not None and timeout.total_seconds() > 0 and not settings.timeout_from_env:
        overrides["collective_timeout_s"] = timeout.total_seconds()
    if host not in LOOPBACK and not settings.bind_from_env:
        # A world over several hosts: listen on every interface, advertise the one that routes
        # to the coordinator (WorkerConfig.advertised_host).
        overrides.update(bind_host="0.0.0.0", advertise_host="auto")
    overrides.update(settings.worker)
    return overrides


def _check(context: api.Context, rank: int, size: int, coordinator: str) -> None:
    """The view must agree with the rank and world size torch was given (-1: not given)."""
    worker = context.worker
    got_rank, got_size = worker.rank, worker.size
    if size >= 0 and got_size != size:
        raise InvalidArgumentError(
            f"torch.distributed was given world_size={size}, but ringserve's first view (view {worker.view_id}, "
            f"coordinator {coordinator}) has {got_size} ranks: start world_size workers, or give the coordinator "
            f"min_workers={size} (ringserve run -np {size} does)."
        )
    if rank >= 0 and got_rank != rank:
        raise InvalidArgumentError(
            f"torch.distributed was given rank={rank}, but ringserve's first view (view {worker.view_id}, coordinator "
            f"{coordinator}) made this process rank {got_rank} of {got_size}: every rank must join with a distinct "
            f"rank in [0, {got_size}) (RANK), or leave the rank to ringserve (init_method='ringserve://host:port')."
        )


def _join(coordinator: str, overrides: dict[str, Any]) -> api.Context:
    # torch's process group needs its rank and size at once: no admission deferred to later.
    api.init(coordinator, **{"admit_when_ready": False, **overrides})
    context = api.context()
    _started.add(context)
    return context


def join_world(store: dist.Store, rank: int, size: int, timeout: timedelta | None, settings: Settings) -> World:
    """The ringserve world of torch's default group: joined (or already joined) and checked.

    Raises:
        InvalidArgumentError: the view disagrees with ``rank`` or ``size``.
        CoordinatorUnreachableError, RendezvousTimeoutError: as ringserve.init().
        DistStoreError: rank 0 did not publish its coordinator within the rendezvous deadline.
    """
    if api.is_initialized():
        context = api.context()
        world = World(context, owned=context in _started)
        _check(context, rank, size, context.config.coordinator)
        return world
    host = _store_host(store)
    overrides = _overrides(settings, rank, timeout, host)
    local: LocalCoordinator | None = None
    coordinator = settings.coordinator
    if not coordinator:
        key = f"{COORDINATOR_KEY}/{settings.attempt}"
        if rank == 0:
            given = CoordinatorConfig.from_env(
                # Options.coordinator_port, else RINGSERVE_PORT, else any free port.
                host="127.0.0.1" if host in LOOPBACK else "0.0.0.0", port=settings.coordinator_port or None,
                min_workers=max(size, 1), max_workers=max(size, 1), settle_s=FIXED_JOB_SETTLE_S,
            )
            config = secured_job(given)  # off loopback, a token made for the job (or the user's)
            local = LocalCoordinator(config)
            coordinator = f"{host}:{local.port}"
            if config.token != given.token:
                # Made here: the other ranks learn it from the job's store, before the address.
                store.set(f"{key}/{TOKEN_KEY}", config.token)
                overrides["token"] = config.token
            store.set(key, coordinator)
            log.info("rank 0 started the job's coordinator at %s", coordinator)
        else:
            limit = api.WorkerConfig.from_env(**overrides).rendezvous_timeout_s
            store.wait([key], timedelta(seconds=limit))
            coordinator = store.get(key).decode()
            if store.check([f"{key}/{TOKEN_KEY}"]):
                overrides["token"] = store.get(f"{key}/{TOKEN_KEY}").decode()
    try:
        context = _join(coordinator, overrides)
    except BaseException:
        if local is not None:
            local.stop(0.0)
        raise
    world = World(context, owned=True, coordinator=local)
    # At exit (a script that never destroys its group), before ringserve's own exit hook: the
    # worker leaves, then rank 0's coordinator waits for the others.
    atexit.register(world.close)
    try:
        _check(context, rank, size, coordinator)
    except BaseException:
        world.close()
        raise
    return world


def _tcp_store(context: api.Context, size: int, timeout: timedelta) -> dist.Store:
    """A TCPStore for torch, served by the view's rank 0 on a free port and announced over the ring."""
    worker = context.worker
    host = worker.address.rpartition(":")[0].strip("[]")
    if worker.rank == 0:
        store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        context.call(lambda w: w.broadcast_object((host, store.port), root=0, name="ringserve.torch.distributed.store"))
        return store
    where: Any = context.call(lambda w: w.broadcast_object(None, root=0, name="ringserve.torch.distributed.store"))
    return dist.TCPStore(where[0], int(where[1]), size, False, timeout=timeout)


def ringserve_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **_: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """torch's rendezvous handler of ``ringserve://host:port`` (``?rank=&world_size=`` from torch).

    Joins the coordinator at host:port (RINGSERVE_COORDINATOR when the address is left out:
    ``ringserve://``), and yields a store, this process's rank and the world size, as the view has
    them (checked against any rank and world size given).
    """
    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    rank, size = int(query.get("rank", -1)), int(query.get("world_size", -1))
    settings = Settings.from_env()
    coordinator = parsed.netloc or settings.coordinator
    if not coordinator:
        raise InvalidArgumentError(
            f"init_method={url!r} names no coordinator: use ringserve://host:port, or set RINGSERVE_COORDINATOR."
        )
    started_here = not api.is_initialized()
    if started_here:
        host = coordinator.rpartition(":")[0].strip("[]")
        context = _join(coordinator, _overrides(settings, rank, timeout, host))
    else:
        context = api.context()
    try:
        _check(context, rank, size, coordinator)
        store = _tcp_store(context, context.worker.size, timeout)
    except BaseException:
        if started_here:
            with contextlib.suppress(Exception):
                api.shutdown()
        raise
    yield store, context.worker.rank, context.worker.size
    raise RuntimeError("The ringserve:// rendezvous cannot be repeated: destroy the process group and init it again.")
