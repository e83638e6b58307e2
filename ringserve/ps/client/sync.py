"""The parameter server from synchronous code, with numpy arrays in and out: any framework's client.

``Client`` runs an ``AsyncClient`` on a loop thread of its own, for the worker of ringserve's
default context (``ringserve.init()``, called here if it was not yet): the worker's id names its
pushes, and its view makes it a member that sync, ssp and average count. Rank 0 offers the initial
values; the others wait for them, so that every worker starts from the same model.

Workers that join while training runs wait to be admitted (see ringserve.coordinator.membership);
rank 0 admits them after a push, so a joiner enters at a step boundary, pulls the current values
and goes on from there.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from ringserve import api
from ringserve.config import PSClientConfig, SecuritySettings
from ringserve.constants import THREAD_WAIT_SLACK_S
from ringserve.errors import CollectiveTimeoutError
from ringserve.loop import LoopThread
from ringserve.ps.client.aio import DEFAULT_OPTIMIZER, AsyncClient, view_of
from ringserve.ps.optim import Optimizer

T = TypeVar("T")


def client_config(context: api.Context, **overrides: Any) -> PSClientConfig:
    """A client's config for a worker: its coordinator and security, RINGSERVE_* for the rest."""
    worker = context.config
    security = {f.name: getattr(worker, f.name) for f in dataclasses.fields(SecuritySettings)}
    return PSClientConfig.from_env(**{"coordinator": worker.coordinator, **security, **overrides})


class Client:
    """A worker's parameter-server client for synchronous code.

    Example:
        ```python
        import ringserve as rs
        from ringserve.ps import Client, Optimizer

        rs.init()
        ps = Client({"w": w, "b": b}, mode="ssp", staleness=2, optimizer=Optimizer(kind="sgd", lr=0.1))
        for x, y in batches:
            values = ps.pull()
            ps.push(gradients(values, x, y))
        ps.close()
        ```
    """

    def __init__(self, tensors: Mapping[str, np.ndarray] | Sequence[tuple[str, np.ndarray]], *, mode: str = "sync",
                 optimizer: Optimizer | Sequence[Optimizer] = DEFAULT_OPTIMIZER, groups: Mapping[str, int] | None = None,
                 staleness: int = 0, sum: bool = False, max_lag: int = 0, config: PSClientConfig | None = None,
                 context: api.Context | None = None, coordinator: str | None = None) -> None:
        """Connects to the shards, declares the job (rank 0 seeds it) and pulls the first values.

        Args:
            tensors, mode, optimizer, groups, staleness, sum, max_lag: see AsyncClient.init.
            config: the client's settings (default: from the worker's and RINGSERVE_*).
            context: the worker to push as (default: ringserve's default context, started if need be).
            coordinator: for that start, the coordinator (default RINGSERVE_COORDINATOR).
        """
        if context is None:
            api.init(coordinator)
            context = api.context()
        self.context = context
        worker = context.worker
        # A worker that came to a running world (admit_when_ready) is ready now that it holds its
        # model: the job's modes count the members of a view, so it waits to be admitted first.
        context.call(lambda w: w.ready_to_join(), context.config.rendezvous_timeout_s + THREAD_WAIT_SLACK_S)
        self.config = config or client_config(context)
        self._thread = LoopThread(use_uvloop=context.config.use_uvloop, name="ringserve-ps-client")
        self.client = AsyncClient(self.config, worker_id=worker.worker_id, view=view_of(worker))
        try:
            self._run(self.client.init(tensors, mode=mode, optimizer=optimizer, groups=groups, staleness=staleness,
                                       sum=sum, max_lag=max_lag, seed=worker.rank == 0),
                      self.config.shard_wait_s + self.config.round_timeout_s)
            self.pull()
        except BaseException:
            self._close()
            raise

    @property
    def mode(self) -> str:
        return self.client.mode

    @property
    def values(self) -> dict[str, np.ndarray]:
        """The values last pulled (arrays that the next pull overwrites)."""
        return self.client.values

    @property
    def versions(self) -> list[int]:
        return self.client.versions

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        wait = (self.config.round_timeout_s if timeout_s is None else timeout_s) + THREAD_WAIT_SLACK_S
        future = self._thread.submit(coro)
        try:
            return future.result(wait)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise CollectiveTimeoutError(f"A parameter-server call did not finish within {wait:g} s.") from None

    def submit(self, call: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Starts ``call(async_client)`` on the client's loop; returns its future (to overlap)."""
        return self._thread.submit(call(self.client))

    def pull(self) -> dict[str, np.ndarray]:
        """The newest values the mode allows (sync waits for the round, ssp for the slowest worker)."""
        return self._run(self.client.pull())

    def push(self, grads: Mapping[str, np.ndarray], *, lrs: Sequence[float] | None = None) -> list[str]:
        """Pushes this step's gradients; returns each shard's outcome (applied, accepted, duplicate, stale)."""
        outcomes = self._run(self.client.push(grads, lrs=lrs))
        self.admit()
        return outcomes

    def push_delta(self, local: Mapping[str, np.ndarray]) -> list[str]:
        """average mode: pushes the local values' change since the last pull."""
        outcomes = self._run(self.client.push_delta(local))
        self.admit()
        return outcomes

    def admit(self) -> None:
        """On rank 0, asks the coordinator to admit the workers waiting to join (a step boundary)."""
        worker = self.context.worker
        if worker.rank == 0 and worker.pending_workers:
            self.context.call(lambda w: w.admit_waiting(), self.context.config.rpc_timeout_s + THREAD_WAIT_SLACK_S)

    def _close(self) -> None:
        try:
            self._thread.run(self.client.close(), self.config.rpc_timeout_s + THREAD_WAIT_SLACK_S)
        finally:
            self._thread.stop()

    def close(self) -> None:
        """Closes the client's channels (the worker stays: ringserve.shutdown() leaves the world)."""
        self._close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
