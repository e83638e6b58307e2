"""Run a function as ringserve workers in Spark barrier-mode tasks, as ``horovod.spark.run`` does.

The driver runs the coordinator; each of ``num_proc`` tasks of one barrier stage runs ``fn`` as a
ringserve worker. Barrier mode starts every task at once and, when one fails, stops the others,
which is what a ring needs. Inside ``fn``, ``ringserve.init()`` (or ``ringserve.torch.init()``)
finds the coordinator through the environment that the task sets, and the task's partition id is
its rank hint, so task ``i`` is rank ``i`` of the first view.

Example:
    ```python
    from pyspark.sql import SparkSession
    import ringserve.spark

    def train(lr):
        import ringserve.torch as hvd
        hvd.init()
        ...
        return hvd.rank(), final_loss

    spark = SparkSession.builder.master("local[4]").getOrCreate()
    results = ringserve.spark.run(train, args=(0.1,), num_proc=4)   # in rank order
    ```

pyspark is an optional dependency (``pip install ringserve[spark]``); importing this module does
not import it. The executors need ringserve (and whatever ``fn`` imports) installed in the Python
that Spark runs there (``PYSPARK_PYTHON``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import socket
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ringserve.config import ADVERTISE_AUTO, CoordinatorConfig, insecure_opted, is_loopback, secured_job
from ringserve.coordinator import Coordinator
from ringserve.errors import InvalidArgumentError, RecoverableError, RingserveError, UsageError
from ringserve.loop import LoopThread
from ringserve.spark.store import LocalStore, Store

log = logging.getLogger("ringserve.spark")

__all__ = ["LocalStore", "SparkTaskError", "Store", "run"]

COORDINATOR_START_TIMEOUT_S = 30.0
COORDINATOR_STOP_TIMEOUT_S = 10.0

# A failing task raises an error that starts with this tag and names its rank; the driver finds it
# in the Spark exception (which wraps it in Java and Python tracebacks) to say which rank failed.
_TAG = "ringserve.spark task"
# How long a task that failed only because another did waits before it reports (see _task).
SECONDARY_FAILURE_DELAY_S = 2.0
_FAILED = re.compile(re.escape(_TAG) + r" of rank (\d+) failed: ([^\n]*)")


class SparkTaskError(RingserveError):
    """A task of ``ringserve.spark.run`` failed, so the Spark job (every task) was stopped.

    Attributes:
        rank: the failing task's rank, or None when Spark failed before any task said which.
    """

    def __init__(self, rank: int | None, detail: str) -> None:
        self.rank = rank
        who = f"The task of rank {rank}" if rank is not None else "A task"
        super().__init__(f"{who} of ringserve.spark.run failed, and the Spark job was stopped: {detail}")


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    *,
    start_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    spark_context: Any = None,
    coordinator_host: str | None = None,
    settle_s: float = 0.5,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` in ``num_proc`` Spark barrier tasks, each a ringserve worker.

    Args:
        fn: the function each task runs; it calls ``ringserve.init()`` (or
            ``ringserve.torch.init()``) itself. It and its arguments are pickled with cloudpickle,
            and its return value must pickle too.
        args: positional arguments of fn.
        kwargs: keyword arguments of fn.
        num_proc: how many tasks (the world size); defaults to the context's default parallelism.
        start_timeout: seconds the tasks may take to start and form the first view
            (RINGSERVE_RENDEZVOUS_TIMEOUT_S of the workers); None keeps the workers' default.
        env: more environment variables for the tasks (any RINGSERVE_* worker setting); they are
            set while fn runs and restored afterwards.
        spark_context: the SparkContext to use; defaults to the active one.
        coordinator_host: the driver address the executors dial; defaults to
            ``spark.driver.host``.
        settle_s: the coordinator's settle window: how long membership must be unchanged before
            the first view forms.

    Returns:
        fn's return values, in rank order.

    Raises:
        SparkTaskError: a task failed (fn raised, or Spark lost the task); names the rank.
        UsageError: pyspark is not installed, or no SparkContext is active.
        InvalidArgumentError: num_proc is not positive, or more than a local master has slots.
    """
    sc = _spark_context(spark_context)
    num_proc = int(num_proc if num_proc is not None else sc.defaultParallelism)
    if num_proc <= 0:
        raise InvalidArgumentError(f"The number of processes (num_proc={num_proc}) must be greater than zero.")
    _check_local_slots(sc, num_proc)
    host = coordinator_host or sc.getConf().get("spark.driver.host") or socket.gethostname()
    local = is_loopback(host)
    given = dict(env or {})
    # Secure by default (config.secured_job): off loopback, a token made for the job unless env
    # gives one (RINGSERVE_TOKEN or RINGSERVE_TOKEN_FILE, read here too) or RINGSERVE_INSECURE=1.
    config = secured_job(CoordinatorConfig(
        host=host if local else "0.0.0.0",
        port=0,
        min_workers=num_proc,
        max_workers=num_proc,
        settle_s=settle_s,
        token=given.get("RINGSERVE_TOKEN", ""),
        token_file=given.get("RINGSERVE_TOKEN_FILE", ""),
    ), insecure=insecure_opted(given) or None)
    task_env = {
        # On a loopback driver every executor is on this machine: keep the ring on loopback too.
        "RINGSERVE_BIND_HOST": host if local else "0.0.0.0",
        "RINGSERVE_ADVERTISE_HOST": host if local else ADVERTISE_AUTO,
    }
    if config.token:  # made here, or the user's: the tasks carry it in their closure, never a command line
        task_env["RINGSERVE_TOKEN"] = config.token
    if start_timeout is not None:
        task_env["RINGSERVE_RENDEZVOUS_TIMEOUT_S"] = str(start_timeout)
    task_env.update(given)

    thread = LoopThread(use_uvloop=True, name="ringserve-spark-coordinator")
    try:
        coordinator = Coordinator(config)
        thread.run(coordinator.start(), COORDINATOR_START_TIMEOUT_S)
        try:
            task_env["RINGSERVE_COORDINATOR"] = f"{_bracket(host)}:{coordinator.port}"
            log.info("ringserve.spark: coordinator on %s, %d barrier tasks", task_env["RINGSERVE_COORDINATOR"], num_proc)
            task = functools.partial(_task, fn, tuple(args), dict(kwargs or {}), task_env)
            rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
            ranked = _collect(sc, rdd, f"ringserve.spark.run: {num_proc} workers")
        finally:
            thread.run(coordinator.stop(), COORDINATOR_STOP_TIMEOUT_S)
    finally:
        thread.stop()
    return [result for _, result in sorted(ranked, key=lambda pair: pair[0])]


def _collect(sc: Any, rdd: Any, description: str) -> list[tuple[int, Any]]:
    """Runs the barrier stage in a job group of its own, so that an interrupt (Ctrl-C) on the
    driver cancels the tasks instead of leaving them running without a coordinator."""
    group = f"ringserve-{uuid.uuid4().hex[:12]}"
    keys = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    previous = {key: sc.getLocalProperty(key) for key in keys}
    sc.setJobGroup(group, description, interruptOnCancel=True)
    try:
        return list(rdd.collect())
    except Exception as e:
        raise _task_error(e) from e
    except BaseException:
        sc.cancelJobGroup(group)
        raise
    finally:
        for key, value in previous.items():
            sc.setLocalProperty(key, value)


def _spark_context(given: Any) -> Any:
    try:
        from pyspark import SparkContext
    except ImportError:
        raise UsageError(
            "ringserve.spark needs pyspark: install it with `pip install ringserve[spark]`."
        ) from None
    sc = given if given is not None else SparkContext._active_spark_context
    if sc is None:
        raise UsageError(
            "ringserve.spark.run needs an active SparkContext: create one first, e.g. "
            "SparkSession.builder.master('local[4]').getOrCreate()."
        )
    return sc


def _check_local_slots(sc: Any, num_proc: int) -> None:
    """A barrier stage with more tasks than slots never starts (Spark retries for minutes), so a
    local master, whose slots are known, is checked here; a cluster may still grow, so it is not."""
    master = str(sc.master)
    match = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", master)
    if match is None:
        return
    cores = match.group(1)
    slots = (os.cpu_count() or 1) if cores == "*" else int(cores or 1)
    slots //= max(1, int(sc.getConf().get("spark.task.cpus") or 1))
    if num_proc > slots:
        raise InvalidArgumentError(
            f"The number of processes (num_proc={num_proc}) is more than the {slots} task slots of "
            f"the Spark master {master}: barrier mode must run every task at once."
        )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _task_error(error: Exception) -> SparkTaskError:
    found = _FAILED.search(str(error))
    if found is not None:
        return SparkTaskError(int(found.group(1)), found.group(2).strip())
    lines = [line for line in str(error).splitlines() if line.strip()]
    return SparkTaskError(None, lines[0] if lines else type(error).__name__)


def _task(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: Mapping[str, str],
    partition: Iterator[int],
) -> Iterator[tuple[int, Any]]:
    """The body of one barrier task, on an executor: fn as the ringserve worker of this rank."""
    from pyspark import BarrierTaskContext

    rank = BarrierTaskContext.get().partitionId()
    for _ in partition:  # one element, the rank; drained so Spark sees the input consumed
        pass
    settings = {**env, "RINGSERVE_RANK_HINT": str(rank)}
    # Spark reuses Python workers between tasks: restore the environment afterwards.
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        result = fn(*args, **kwargs)
        _leave_if_still_initialized()
    except BaseException as e:
        # Raised without leaving the world first: Spark stops the other tasks, and this Python
        # worker then exits. The other ranks then fail too, with a recoverable error (a peer's
        # stream ended); Spark names only the first failure it hears of, so those secondary
        # failures wait a moment, and the rank that failed first for its own reason is named.
        if isinstance(e, RecoverableError):
            time.sleep(SECONDARY_FAILURE_DELAY_S)
        detail = f"{type(e).__name__}: {e}".replace("\n", " ")
        raise RuntimeError(f"{_TAG} of rank {rank} failed: {detail}\n{traceback.format_exc()}") from e
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    yield rank, result


def _leave_if_still_initialized() -> None:
    """If fn returned without calling shutdown(), leave the world: Spark may reuse this Python
    process for another task, whose init() must not find this one's worker."""
    from ringserve import api

    if api.is_initialized():
        with contextlib.suppress(Exception):
            api.shutdown()
