"""``RayExecutor``: ringserve workers as Ray actors, in the shape of ``horovod.ray.RayExecutor``.

The driver runs the coordinator, on a loop thread of its own (as ``ringserve.spark.run`` does): it
carries no tensors, only membership, so it costs the driver little, and it lives exactly as long as
the executor. Each worker is a Ray actor, placed in a bundle of one placement group (gang
scheduling: the actors of a fixed world start together or not at all), with the coordinator's
address, its rank hint and its node's address in its environment; the functions it runs call
``ringserve.init()`` or ``ringserve.torch.init()`` themselves, as under ``horovod.ray``.

Elastic (``min_workers``/``max_workers``): the coordinator forms views between the bounds, the
functions train with ``ringserve.elastic`` (or ``ringserve.torch.elastic``) State and ``run``, and
the executor replaces an actor that dies with a new one in the same bundle, which joins at the next
commit. The rules are outcomes.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:
    raise ImportError(f"ringserve.ray needs Ray: install it with `pip install 'ringserve[ray]'` ({exc}).") from exc

from ringserve._proto import coordinator_pb2 as pb
from ringserve.config import CoordinatorConfig, is_loopback, secured_job
from ringserve.coordinator import Coordinator
from ringserve.errors import InvalidArgumentError, RendezvousTimeoutError, UsageError
from ringserve.loop import LoopThread
from ringserve.ray import outcomes
from ringserve.ray.actor import WorkerActor, is_recoverable
from ringserve.ray.settings import RaySettings, RayWorkerError

log = logging.getLogger("ringserve.ray")

COORDINATOR_START_TIMEOUT_S = 30.0
COORDINATOR_STOP_TIMEOUT_S = 10.0
# How long shutdown() lets the actors leave the world before it kills them.
LEAVE_TIMEOUT_S = 10.0
# The elastic run looks at its actors (and at replacements that are due) this often.
POLL_S = 0.5


def _cause(error: BaseException) -> BaseException | None:
    """The exception a function raised inside an actor, from Ray's wrapper of it."""
    return getattr(error, "cause", None)


class RayExecutor:
    """Runs functions on ringserve workers that are Ray actors (Horovod's ``RayExecutor``).

    Example:
        ```python
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4)
        ex.start()
        results = ex.run(train, args=[config])    # one per rank, in rank order
        ex.shutdown()
        ```

    Args:
        settings: see RaySettings (``create_settings``).
        num_workers: the world's size (elastic: how many actors start; default min_workers).
        num_hosts, num_workers_per_host: instead of num_workers, ``num_hosts`` bundles spread
            over distinct nodes, each running ``num_workers_per_host`` workers.
        cpus_per_worker, use_gpu, gpus_per_worker: each actor's resources (a GPU each with use_gpu).
        min_workers, max_workers: make the world elastic within these bounds.
        reset_limit: elastic: at most this many dead actors are replaced (None: no limit).
        cooldown_range: elastic: (low, high) seconds to wait before placing a replacement; the low
            end is used.
        elastic_timeout: elastic: how long survivors wait for a view (RINGSERVE_ELASTIC_TIMEOUT_S).

    Raises:
        InvalidArgumentError: sizes or bounds that cannot hold.
    """

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        *,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] | None = None,
        elastic_timeout: float = 600.0,
    ) -> None:
        self.settings = settings or RaySettings()
        self.elastic = min_workers is not None or max_workers is not None
        if num_hosts is not None:
            if num_workers is not None:
                raise InvalidArgumentError("Give num_workers, or num_hosts and num_workers_per_host, not both.")
            if num_hosts <= 0 or num_workers_per_host <= 0:
                raise InvalidArgumentError(
                    f"num_hosts ({num_hosts}) and num_workers_per_host ({num_workers_per_host}) must be greater than zero."
                )
            num_workers = num_hosts * num_workers_per_host
        if self.elastic:
            low = min_workers if min_workers is not None else 1
            num_workers = num_workers if num_workers is not None else low
            high = max_workers if max_workers is not None else max(num_workers, low)
            if not 1 <= low <= num_workers <= high:
                raise InvalidArgumentError(
                    f"An elastic RayExecutor needs 1 <= min_workers ({low}) <= num_workers ({num_workers}) "
                    f"<= max_workers ({high})."
                )
            self.min_workers, self.max_workers = low, high
        else:
            if num_workers is None or num_workers <= 0:
                raise InvalidArgumentError(
                    f"The number of workers (num_workers={num_workers!r}) must be greater than zero."
                )
            self.min_workers = self.max_workers = num_workers
        if reset_limit is not None and reset_limit < 0:
            raise InvalidArgumentError(f"reset_limit ({reset_limit}) must not be negative.")
        if cpus_per_worker < 0 or (gpus_per_worker is not None and gpus_per_worker < 0):
            raise InvalidArgumentError(
                f"cpus_per_worker ({cpus_per_worker}) and gpus_per_worker ({gpus_per_worker}) must not be negative."
            )
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host if num_hosts is not None else 1
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker if gpus_per_worker is not None else 1) if use_gpu else 0
        self.reset_limit = reset_limit
        self.cooldown_s = cooldown_range[0] if cooldown_range else 1.0
        self.elastic_timeout = elastic_timeout
        self.workers: list[Any] = []  # the actors, by slot
        self._thread: LoopThread | None = None
        self._coordinator: Coordinator | None = None
        self._group: Any = None
        self._env: dict[str, str] = {}
        self._executable: tuple[type | None, tuple[Any, ...], dict[str, Any]] = (None, (), {})

    @staticmethod
    def create_settings(timeout_s: float = 30, *, placement_group_timeout_s: float = 100, http_port: int = -1,
                        env: Mapping[str, str] | None = None,
                        coordinator: Mapping[str, Any] | None = None) -> RaySettings:
        """The settings of an executor (Horovod's ``RayExecutor.create_settings``)."""
        return RaySettings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s,
                           http_port=http_port, env=dict(env or {}), coordinator=dict(coordinator or {}))

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def coordinator_address(self) -> str:
        """host:port of the job's coordinator, as the workers dial it (after start)."""
        self._require_started()
        return self._env["RINGSERVE_COORDINATOR"]

    @property
    def status_url(self) -> str | None:
        """The coordinator's status page, if settings.http_port asked for one."""
        page = self._require_started().status_page
        return page.url if page is not None else None

    def start(self, executable_cls: type | None = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: Mapping[str, Any] | None = None,
              extra_env_vars: Mapping[str, str] | None = None) -> None:
        """Starts the coordinator, places the actors and sets each one up.

        Args:
            executable_cls: a class each actor makes one of; ``execute`` hands it to its function.
            executable_args, executable_kwargs: its constructor's arguments.
            extra_env_vars: more environment variables for the workers.

        Raises:
            RendezvousTimeoutError: the placement group, or the actors, did not start in time.
            UsageError: start() was already called.
        """
        if self._coordinator is not None:
            raise UsageError("This RayExecutor has already started: shut it down first.")
        if not ray.is_initialized():
            ray.init()  # what Ray's first remote call would do; the driver's node address comes from it
        host = ray.util.get_node_ip_address()
        local = is_loopback(host)
        # Secure by default (config.secured_job): off loopback, a token made for the job unless
        # settings.coordinator gives one (or a token file, or client certificates), or the driver
        # runs with RINGSERVE_INSECURE=1.
        config = secured_job(CoordinatorConfig(**{
            "host": host if local else "0.0.0.0", "port": 0, "min_workers": self.min_workers,
            "max_workers": self.max_workers, "http_port": self.settings.http_port, **self.settings.coordinator,
        }))
        self._thread = LoopThread(use_uvloop=True, name="ringserve-ray-coordinator")
        try:
            self._coordinator = self._thread.run(Coordinator(config).start(), COORDINATOR_START_TIMEOUT_S)
            address = f"[{host}]:{self._coordinator.port}" if ":" in host else f"{host}:{self._coordinator.port}"
            self._env = {
                "RINGSERVE_COORDINATOR": address,
                "RINGSERVE_RENDEZVOUS_TIMEOUT_S": str(self.settings.timeout_s),
                **({"RINGSERVE_ELASTIC_TIMEOUT_S": str(self.elastic_timeout)} if self.elastic else {}),
                **self.settings.env, **(extra_env_vars or {}),
            }
            if config.token:  # the actors carry it in their environment, never a command line
                self._env.setdefault("RINGSERVE_TOKEN", config.token)
            self._executable = (executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {}))
            self._place()
            log.info("RayExecutor: coordinator on %s, %d workers", address, self.num_workers)
        except BaseException:
            self.shutdown()
            raise

    def _place(self) -> None:
        bundle = {"CPU": self.cpus_per_worker * self.num_workers_per_host}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker * self.num_workers_per_host
        bundles = self.num_hosts if self.num_hosts is not None else self.num_workers
        strategy = "STRICT_SPREAD" if self.num_hosts is not None else "PACK"
        self._group = placement_group([dict(bundle) for _ in range(bundles)], strategy=strategy)
        ready, _ = ray.wait([self._group.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            raise RendezvousTimeoutError(
                f"The placement group of {bundles} bundles of {bundle} ({strategy}) was not placed within "
                f"{self.settings.placement_group_timeout_s:g} s: the cluster lacks the resources."
            )
        self.workers = [self._actor(slot) for slot in range(self.num_workers)]
        ready, pending = ray.wait([w.node.remote() for w in self.workers], num_returns=len(self.workers),
                                  timeout=self.settings.timeout_s)
        if pending:
            raise RendezvousTimeoutError(
                f"{len(pending)} of the {len(self.workers)} actors did not start within {self.settings.timeout_s:g} s."
            )
        for found in ray.get(ready):
            log.debug("RayExecutor: a worker on %s (%s, pid %d)", *found)

    def _actor(self, slot: int) -> Any:
        """A new actor in ``slot``'s bundle, set up (the setup call is queued before any other)."""
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self._group, placement_group_bundle_index=slot // self.num_workers_per_host)
        remote = ray.remote(WorkerActor).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, scheduling_strategy=strategy,
            max_restarts=0, max_task_retries=0)
        actor = remote.remote({**self._env, "RINGSERVE_RANK_HINT": str(slot)})
        actor.setup.remote(*self._executable)
        return actor

    def shutdown(self) -> None:
        """Leaves the world on every actor (within LEAVE_TIMEOUT_S), kills them, removes the
        placement group and stops the coordinator. Safe to call twice."""
        workers, self.workers = self.workers, []
        if workers:
            ray.wait([w.leave.remote() for w in workers], num_returns=len(workers), timeout=LEAVE_TIMEOUT_S)
            for worker in workers:
                ray.kill(worker, no_restart=True)
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        thread, coordinator = self._thread, self._coordinator
        self._thread = self._coordinator = None
        if thread is not None:
            try:
                if coordinator is not None:
                    thread.run(coordinator.stop(), COORDINATOR_STOP_TIMEOUT_S)
            finally:
                thread.stop()

    def _require_started(self) -> Coordinator:
        if self._coordinator is None:
            raise UsageError("This RayExecutor has not started: call start() first.")
        return self._coordinator

    def status(self) -> pb.StatusResponse:
        """The coordinator's Status now (what ``ringserve status`` and the status page show)."""
        coordinator = self._require_started()
        assert self._thread is not None

        async def read() -> pb.StatusResponse:
            return coordinator.service.status(pb.StatusRequest())

        return self._thread.run(read(), COORDINATOR_START_TIMEOUT_S)

    # -- running functions -------------------------------------------------------------------

    def execute(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""
        self._require_started()
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the worker of rank 0 only."""
        self._require_started()
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Starts ``fn(*args, **kwargs)`` on every worker; returns their ObjectRefs, in rank order."""
        self._require_started()
        return [w.run.remote(fn, tuple(args or ()), dict(kwargs or {})) for w in self.workers]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every worker and waits for all of them.

        Returns:
            fn's return values, in rank order. Elastic: those of the workers that finished, by the
            rank they ended in (a worker whose fn shut ringserve down itself comes last).

        Raises:
            RayWorkerError: a worker's fn raised, or (in a fixed world) its actor died; names the
                rank. Elastic: also when every actor died and none could be replaced.
        """
        if self.elastic:
            return self._run_elastic(fn, tuple(args or ()), dict(kwargs or {}))
        return self._gather(self.run_remote(fn, args, kwargs))

    def _outcome(self, slot: int, ref: Any) -> outcomes.Outcome:
        try:
            value = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            return outcomes.Outcome(slot, ok=False, died=True, error=str(exc).splitlines()[0] if str(exc) else "")
        except ray.exceptions.RayTaskError as exc:
            cause = _cause(exc)
            detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc).splitlines()[0]
            return outcomes.Outcome(slot, ok=False, error=detail, recoverable=is_recoverable(cause))
        return outcomes.Outcome(slot, ok=True, value=value)

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every ref's value, in order; the first failure (the primary one) as a RayWorkerError."""
        pending = {ref: slot for slot, ref in enumerate(refs)}
        values: dict[int, Any] = {}
        failures: list[outcomes.Outcome] = []
        while pending:
            timeout = outcomes.SECONDARY_FAILURE_DELAY_S if failures else None
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                break
            for ref in ready:
                outcome = self._outcome(pending.pop(ref), ref)
                if outcome.ok:
                    values[outcome.slot] = outcome.value
                else:
                    failures.append(outcome)
        if failures:
            first = outcomes.primary(failures)
            raise RayWorkerError(first.slot, first.error, died=first.died)
        return [values[slot] for slot in range(len(refs))]

    def _run_elastic(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        plan = outcomes.Elastic(self.reset_limit)
        pending = {w.run_elastic.remote(fn, args, kwargs): slot for slot, w in enumerate(self.workers)}
        due: dict[int, float] = {}  # slots whose replacement is placed at this time
        while pending or due:
            now = time.monotonic()
            for slot, at in sorted(due.items()):
                if at <= now:
                    del due[slot]
                    self.workers[slot] = self._actor(slot)
                    pending[self.workers[slot].run_elastic.remote(fn, args, kwargs)] = slot
                    log.info("RayExecutor: a replacement actor placed in slot %d", slot)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S) if pending else ([], [])
            for ref in ready:
                outcome = self._outcome(pending.pop(ref), ref)
                if outcome.ok:
                    rank, size, value = outcome.value
                    plan.on_return(outcomes.Outcome(outcome.slot, ok=True, value=value, rank=rank, size=size))
                elif outcome.died:
                    log.warning("RayExecutor: the actor in slot %d died: %s", outcome.slot, outcome.error)
                    if plan.on_death(outcome):
                        due[outcome.slot] = time.monotonic() + self.cooldown_s
                else:
                    raise RayWorkerError(outcome.slot, outcome.error)
            if plan.finishing:
                due.clear()
                if pending and plan.complete(world_empty=self.status().view_size == 0):
                    self._let_go(pending)
                    pending.clear()
        if not plan.done:
            last = plan.deaths[-1] if plan.deaths else outcomes.Outcome(0, ok=False, error="no worker ran")
            raise RayWorkerError(last.slot, f"every actor died and none could be replaced ({last.error})", died=True)
        return outcomes.in_rank_order(plan.done)

    def _let_go(self, pending: Mapping[Any, int]) -> None:
        """Ends the actors still waiting to be admitted when the job finished; fresh ones take their
        slots, so that the executor can run again."""
        for slot in sorted(set(pending.values())):
            log.info("RayExecutor: the actor in slot %d was not admitted before the job finished", slot)
            ray.kill(self.workers[slot], no_restart=True)
            self.workers[slot] = self._actor(slot)
