"""The Ray actor that is one ringserve worker: one process, its environment, and the calls the
executor makes on it. Made remote by the executor (``ray.remote(WorkerActor)``), so that this
module imports nothing of Ray's and its behaviour can be read (and tested) as a plain class.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from ringserve import api
from ringserve.errors import RecoverableError, RingserveError


class WorkerActor:
    """One worker's process. The environment it is given (the coordinator, the rank hint and any
    RINGSERVE_* setting) is set when it starts, so that ``ringserve.init()`` or
    ``ringserve.torch.init()`` inside the functions it runs finds the job.

    Args:
        env: environment variables for this process.
        node_ip: the address of this actor's node as Ray knows it; the worker binds and
            advertises it unless ``env`` says otherwise. Empty: found here.
    """

    def __init__(self, env: Mapping[str, str], node_ip: str = "") -> None:
        os.environ.update(env)
        if not node_ip:
            import ray

            node_ip = ray.util.get_node_ip_address()
        os.environ.setdefault("RINGSERVE_BIND_HOST", node_ip)
        os.environ.setdefault("RINGSERVE_ADVERTISE_HOST", node_ip)
        self.node_ip = node_ip
        self.executable: Any = None

    def node(self) -> tuple[str, str, int]:
        """(node address, host name, process id): where this worker runs."""
        return self.node_ip, socket.gethostname(), os.getpid()

    def setup(self, executable_cls: type | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Makes the object that ``execute`` hands its functions (Horovod's executable_cls)."""
        self.executable = executable_cls(*args, **kwargs) if executable_cls is not None else None

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)``, as Horovod's ``execute`` calls it."""
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``. If it raises, this worker leaves the world first: the others
        then fail at once with a recoverable error (their ring changed) instead of waiting on this
        rank until their collective deadline."""
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.leave()
            raise

    def run_elastic(self, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[int | None, int | None, Any]:
        """``run``, and the rank and world size it ended in (None when fn shut ringserve down)."""
        value = self.run(fn, args, kwargs)
        if not api.is_initialized():
            return None, None, value
        return api.rank(), api.size(), value

    def leave(self) -> None:
        """Leaves the world, if this process is in it (the executor's shutdown, or a failure)."""
        if api.is_initialized():
            with contextlib.suppress(RingserveError):  # its leave could not be said: the others find out
                api.shutdown()


def is_recoverable(error: BaseException | None) -> bool:
    """Whether an error a function raised is a consequence of another rank's failure."""
    return isinstance(error, RecoverableError)
