"""``ringserve.ParameterServer``: S shards run from a synchronous program, and kept running.

Two ways to run them:

- **processes** (the default, and what ``ringserve ps --shards S`` and ``ringserve run --ps S``
  use): one ``ringserve ps --one-shard`` process per shard, so shards apply updates on separate
  cores (one process's shards would share its interpreter lock). A shard that exits is started
  again with the same index and shard id, and resumes from its newest checkpoint (with
  ``checkpoint_dir``) or is seeded again by the workers from the values they last pulled; up to
  ``max_restarts`` times in all.
- **in this process** (``processes=False``): the shards are asyncio servers on one background
  event loop; for tests and small jobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from types import TracebackType

import grpc

from ringserve.config import ShardConfig
from ringserve.errors import InvalidArgumentError, RingserveError
from ringserve.loop import LoopThread
from ringserve.ps.shard.node import Shard

log = logging.getLogger("ringserve.ps")

# How often the supervisor looks at its shard processes.
POLL_S = 0.1
# A shard process is asked to stop (SIGTERM, it writes its last checkpoint) and killed after this.
STOP_GRACE_S = 10.0
# What a shard process may take to start (the interpreter and its imports) before its register_timeout_s
# begins: 10-13 s from `ringserve run --ps 2` to both shards serving at a load average of 29 on 2 cores.
STARTUP_S = 30.0
# A shard process that exits within this of its start does not get restarted at once, but after it.
RESTART_BACKOFF_S = 1.0


class ParameterServer:
    """S parameter-server shards that register with a coordinator.

    Example:
        ```python
        with ringserve.ParameterServer(coordinator="127.0.0.1:50051", shards=2) as ps:
            print(ps.addresses)          # the shards' addresses once they have registered
        ```
    """

    def __init__(self, coordinator: str | None = None, *, shards: int | None = None, config: ShardConfig | None = None,
                 processes: bool = True, max_restarts: int = 10, env: Mapping[str, str] | None = None,
                 start_timeout_s: float | None = None) -> None:
        """Args:
            coordinator: host:port of the coordinator (default: the config's).
            shards: S (default: the config's).
            config: the shards' settings (default: ShardConfig.from_env()); shard_index is set per shard.
            processes: one process per shard (see the module docstring), else in this process.
            max_restarts: shard processes started again in all, before the server gives up on one.
            env: the shard processes' environment (default: this process's).
            start_timeout_s: how long start() waits for every shard to register (default: the
                config's register_timeout_s, plus STARTUP_S for the shard processes to start).
        """
        base = config or ShardConfig.from_env()
        shards = base.shards if shards is None else shards
        if shards < 1:
            raise InvalidArgumentError(f"The number of shards ({shards}) must be at least 1.")
        overrides: dict[str, object] = {"shards": shards}
        if coordinator:
            overrides["coordinator"] = coordinator
        self.config = dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
        self.processes = processes
        self.max_restarts = max_restarts
        self.restarts = 0
        self._env = dict(os.environ if env is None else env)
        self._start_timeout_s = self.config.register_timeout_s + STARTUP_S if start_timeout_s is None else start_timeout_s
        self._job = uuid.uuid4().hex[:12]
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._started_at: dict[int, float] = {}
        self._thread: LoopThread | None = None
        self._shards: list[Shard] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()
        self.failure: str = ""
        self.listed: list[str] = []

    def shard_id(self, index: int) -> str:
        return f"{self._job}-{index}"

    @property
    def addresses(self) -> list[str]:
        """The shards' addresses, by index, as they registered when start() returned."""
        if self.processes:
            return list(self.listed)
        return [s.address for s in sorted(self._shards, key=lambda s: s.index)]

    @property
    def shards(self) -> list[Shard]:
        """The in-process shards (empty with processes)."""
        return list(self._shards)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> ParameterServer:
        """Starts the shards and waits until each has registered (processes: until each serves).

        Raises:
            RingserveError: a shard could not start or register within start_timeout_s.
        """
        if not self.processes:
            self._thread = LoopThread(use_uvloop=self.config.use_uvloop, name="ringserve-ps")
            try:
                for i in range(self.config.shards):
                    shard = Shard(dataclasses.replace(self.config, shard_index=i), shard_id=self.shard_id(i))
                    self._thread.run(shard.start(), self._start_timeout_s)
                    self._shards.append(shard)
            except BaseException:
                self.stop()
                raise
            return self
        for i in range(self.config.shards):
            self._spawn(i)
        try:
            self.listed = self._wait_registered()
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._supervise, name="ringserve-ps-supervisor", daemon=True)
        self._watcher.start()
        return self

    def _wait_registered(self) -> list[str]:
        """Waits until the coordinator lists every shard process alive; returns their addresses."""
        from ringserve._proto import coordinator_pb2 as cpb
        from ringserve._proto import coordinator_pb2_grpc as cpb_grpc
        from ringserve.security import Security

        cfg = self.config
        deadline = time.monotonic() + self._start_timeout_s
        ids = {self.shard_id(i): i for i in range(cfg.shards)}
        with Security.load(cfg).sync_channel(cfg.coordinator) as channel:
            stub = cpb_grpc.CoordinatorStub(channel)
            while True:
                for index, proc in self._procs.items():
                    if proc.poll() is not None:
                        raise RingserveError(f"Parameter-server shard {index} exited with code {proc.returncode} "
                                             f"before it registered with the coordinator at {cfg.coordinator}.")
                try:
                    listing = stub.ListShards(cpb.ListShardsRequest(), timeout=cfg.rpc_timeout_s)
                    found = {e.shard_id: e.address for e in listing.entries if e.alive and e.shard_id in ids}
                    if len(found) == len(ids):
                        return [found[self.shard_id(i)] for i in range(cfg.shards)]
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RingserveError(f"The {cfg.shards} parameter-server shards did not all register with the "
                                         f"coordinator at {cfg.coordinator} within {self._start_timeout_s:g} s.")
                time.sleep(POLL_S)

    def _argv(self, index: int) -> list[str]:
        return [sys.executable, "-m", "ringserve.cli", "ps", "--one-shard", "--shard-index", str(index),
                "--shard-id", self.shard_id(index), "--parent", str(os.getpid())]

    def _child_env(self) -> dict[str, str]:
        """The shard processes' environment: this server's whole config as RINGSERVE_* variables
        (what ShardConfig.from_env reads back), over the given environment."""
        env = dict(self._env)
        for f in dataclasses.fields(self.config):
            value = getattr(self.config, f.name)
            if f.name != "shard_index":
                env[f"RINGSERVE_{f.name.upper()}"] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return env

    def _spawn(self, index: int) -> None:
        self._procs[index] = subprocess.Popen(self._argv(index), env=self._child_env(), stdin=subprocess.DEVNULL)
        self._started_at[index] = time.monotonic()

    def _supervise(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                for index, proc in list(self._procs.items()):
                    code = proc.poll()
                    if code is None or self._stop.is_set():
                        continue
                    if self.restarts >= self.max_restarts:
                        self.failure = (f"parameter-server shard {index} exited with code {code}, and the "
                                        f"{self.max_restarts} restarts allowed are spent")
                        log.error("%s", self.failure)
                        del self._procs[index]
                        continue
                    if time.monotonic() - self._started_at[index] < RESTART_BACKOFF_S:
                        continue
                    self.restarts += 1
                    log.warning("parameter-server shard %d exited with code %d: starting it again (%d of %d)",
                                index, code, self.restarts, self.max_restarts)
                    self._spawn(index)

    def pids(self) -> dict[int, int]:
        """The shard processes' ids, by index (processes only)."""
        with self._lock:
            return {i: p.pid for i, p in self._procs.items()}

    def stop(self) -> None:
        """Stops every shard; shard processes write their last checkpoint first (SIGTERM)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
            self._watcher = None
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            try:
                for shard in self._shards:
                    self._thread.run(shard.stop(), STOP_GRACE_S)
            finally:
                self._shards.clear()
                self._thread.stop()
                self._thread = None

    def __enter__(self) -> ParameterServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def serve(config: ShardConfig, *, one_shard: bool, shard_id: str = "", parent: int = 0) -> int:
    """``ringserve ps``: runs the shards until SIGINT or SIGTERM; returns the exit code.

    One shard (``one_shard``) runs in this process; otherwise ``ParameterServer`` runs S shard
    processes and keeps them running. A stopped shard writes its last checkpoint first. With
    ``parent`` (a supervisor's pid), the shard also stops when that process is gone, so that a
    supervisor killed outright leaves no shard behind.
    """
    from ringserve.loop import new_event_loop

    if one_shard:
        loop = new_event_loop(use_uvloop=config.use_uvloop)
        try:
            return loop.run_until_complete(_serve_one(config, shard_id, parent))
        finally:
            loop.close()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    with ParameterServer(config=config, processes=True) as server:
        print(f"ringserve ps: {config.shards} shards registered with the coordinator at {config.coordinator}",
              flush=True)
        while not stop.wait(0.2):
            if server.failure:
                print(f"ringserve ps: {server.failure}", file=sys.stderr, flush=True)
                return 1
    return 0


async def _orphaned(parent: int) -> None:
    """Returns once the process that started this one is gone.

    A pidfd of the parent becomes readable when it exits (Linux 5.3 and later), so nothing polls.

    Args:
        parent: the pid of the process that started this one.
    """
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        return
    try:
        if os.getppid() != parent:  # gone before the pidfd was opened (its pid may be reused)
            return
        gone = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, gone.set)
        try:
            await gone.wait()
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


async def _serve_one(config: ShardConfig, shard_id: str, parent: int = 0) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Shard(config, shard_id=shard_id) as shard:
        resumed = f", resumed from {shard.restored_from}" if shard.restored_from else ""
        print(f"ringserve ps: shard {shard.index} of {config.shards} serving on {shard.address}{resumed}", flush=True)
        stopped = loop.create_task(stop.wait())
        failed = loop.create_task(shard.wait())
        waits = [stopped, failed]
        if parent:
            waits.append(loop.create_task(_orphaned(parent)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if failed.done() and not failed.cancelled() and failed.exception() is not None:
            print(f"ringserve ps: shard {shard.index}: {failed.exception()}", file=sys.stderr, flush=True)
            return 1
    return 0
