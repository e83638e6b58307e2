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

import dataclasses
import logging
import os
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
from ringserve.ps.shard import Shard

log = logging.getLogger("ringserve.ps")

# How often the supervisor looks at its shard processes.
POLL_S = 0.1
# A shard process is asked to stop (SIGTERM, it writes its last checkpoint) and killed after this.
STOP_GRACE_S = 10.0
# A shard process that exits within this of its start does not get restarted at once, but after it.
RESTART_BACKOFF_S = 1.0
# Settings a shard process takes from its command line, not from the environment.
_FLAGS = {"coordinator": "--coordinator", "shards": "--shards", "bind_host": "--bind-host",
          "advertise_host": "--advertise-host", "checkpoint_dir": "--checkpoint-dir",
          "checkpoint_updates": "--checkpoint-updates"}


class ParameterServer:
    """S parameter-server shards that register with a coordinator.

    Example::

        with ringserve.ParameterServer(coordinator="127.0.0.1:50051", shards=2) as ps:
            print(ps.addresses)          # the shards' addresses once they have registered
    """

    def __init__(self, coordinator: str | None = None, *, shards: int = 1, config: ShardConfig | None = None,
                 processes: bool = True, max_restarts: int = 10, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 60.0) -> None:
        """Args:
            coordinator: host:port of the coordinator (default: the config's).
            shards: S.
            config: the shards' settings (default: ShardConfig.from_env()); shard_index is set per shard.
            processes: one process per shard (see the module docstring), else in this process.
            max_restarts: shard processes started again in all, before the server gives up on one.
            env: the shard processes' environment (default: this process's).
            start_timeout_s: how long start() waits for every shard to register.
        """
        base = config or ShardConfig.from_env()
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
        self._start_timeout_s = start_timeout_s
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
        argv = [sys.executable, "-m", "ringserve.cli", "ps", "--one-shard", "--shard-index", str(index),
                "--shard-id", self.shard_id(index)]
        for name, flag in _FLAGS.items():
            value = getattr(self.config, name)
            if value != "":
                argv += [flag, str(value)]
        return argv

    def _spawn(self, index: int) -> None:
        self._procs[index] = subprocess.Popen(self._argv(index), env=self._env, stdin=subprocess.DEVNULL)
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
