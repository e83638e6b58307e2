"""The backend's settings: ``Options`` (torch's ``pg_options``) over the RINGSERVE_* environment.

``init_process_group("ringserve", pg_options=Options(compression="int8"))`` hands ``Options`` to the
backend as torch hands any backend its options; a field left at None takes the environment's
value, and then the default. The environment is read here only, by ``Settings.from_env``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ringserve import codecs
from ringserve.errors import InvalidArgumentError

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The ringserve backend's options (``init_process_group(..., pg_options=Options(...))``).

    Attributes:
        compression: how all_reduce sends floating point SUM and AVG tensors: "fp16", "bf16",
            "int8" (see ringserve.codecs for each one's error bound) or "none". Default:
            RINGSERVE_COMPRESSION, else none.
        error_feedback: with a lossy compression, keep what each all_reduce's encoding lost and
            add it to the next all_reduce of the same tensor (DDP's buckets are the same tensors
            from step to step), so that training converges as uncompressed. Default: True.
        coordinator: host:port of a running coordinator to join. Default: RINGSERVE_COORDINATOR
            (``ringserve run`` sets it); without one, rank 0 starts a coordinator in its own
            process and the others find it through torch's store.
        coordinator_port: the port that a coordinator started by rank 0 binds. Default:
            RINGSERVE_PORT, else a free one (it is published in torch's store either way). Fix it
            where a firewall must let a known port through.
        worker: WorkerConfig fields (``collective_timeout_s``, ``shared_memory``, ...) over the
            environment's, for a worker this backend starts.

    Example:
        ```python
        dist.init_process_group("ringserve", pg_options=Options(compression="bf16"))
        ```
    """

    compression: str | None = None
    error_feedback: bool | None = None
    coordinator: str | None = None
    coordinator_port: int | None = None
    worker: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the backend runs with, resolved from ``Options`` and the environment.

    Attributes:
        compression: the codec of all_reduce (None: raw values).
        error_feedback: keep residuals of lossy all_reduces.
        coordinator: the coordinator to join ("" : rank 0 starts one).
        coordinator_port: the port of a coordinator that rank 0 starts (0: any free one).
        worker: WorkerConfig overrides from Options.
        timeout_from_env: RINGSERVE_COLLECTIVE_TIMEOUT_S is set, so it wins over torch's default
            timeout (a timeout given to init_process_group or new_group wins over it).
        bind_from_env: RINGSERVE_BIND_HOST or RINGSERVE_ADVERTISE_HOST is set, so the backend does
            not choose the addresses for a world spread over several hosts.
        attempt: torchrun's restart count (TORCHELASTIC_RESTART_COUNT), so that a restarted
            job's rank 0 publishes its new coordinator under a key of its own in torch's store.
    """

    compression: str | None = None
    error_feedback: bool = True
    coordinator: str = ""
    coordinator_port: int = 0
    worker: Mapping[str, Any] = field(default_factory=dict)
    timeout_from_env: bool = False
    bind_from_env: bool = False
    attempt: str = "0"

    def __post_init__(self) -> None:
        codecs.codec(self.compression)  # an unknown name fails here, naming the choices
        if not 0 <= self.coordinator_port <= 65535:
            raise InvalidArgumentError(f"Options.coordinator_port ({self.coordinator_port}) must be in [0, 65535].")
        if self.coordinator and ":" not in self.coordinator:
            raise InvalidArgumentError(f"The coordinator address ({self.coordinator!r}) must have the form host:port.")

    @classmethod
    def from_env(cls, options: object = None, env: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``options`` (an ``Options``, or None) over RINGSERVE_* variables.

        Raises:
            InvalidArgumentError: ``options`` is not an ``Options``, or a value is invalid.
        """
        env = os.environ if env is None else env
        if options is None:
            options = Options()
        if not isinstance(options, Options):
            raise InvalidArgumentError(
                f"The ringserve backend takes pg_options=ringserve.torch.distributed.Options(...), not {options!r}."
            )
        compression = options.compression if options.compression is not None else env.get("RINGSERVE_COMPRESSION") or None
        if compression == "none":
            compression = None
        feedback = options.error_feedback
        if feedback is None:
            raw = env.get("RINGSERVE_ERROR_FEEDBACK", "")
            feedback = raw.strip().lower() not in ("0", "false", "no", "off") if raw else True
        return cls(
            compression=compression,
            error_feedback=feedback,
            coordinator=options.coordinator if options.coordinator is not None else env.get("RINGSERVE_COORDINATOR", ""),
            coordinator_port=options.coordinator_port or 0,
            worker=dict(options.worker),
            timeout_from_env=bool(env.get("RINGSERVE_COLLECTIVE_TIMEOUT_S")) or "collective_timeout_s" in options.worker,
            bind_from_env=bool(env.get("RINGSERVE_BIND_HOST") or env.get("RINGSERVE_ADVERTISE_HOST")),
            attempt=env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0",
        )
