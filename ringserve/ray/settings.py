"""What a RayExecutor is given and what it raises; importable without Ray."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ringserve.errors import InvalidArgumentError, RingserveError


class RayWorkerError(RingserveError):
    """A worker of a RayExecutor failed: its function raised, or its actor died.

    Attributes:
        rank: the failing worker's rank (its slot: the rank hint it started with).
        died: the actor died (killed, its node lost, out of memory), rather than raising.
    """

    def __init__(self, rank: int, detail: str, *, died: bool = False) -> None:
        self.rank = rank
        self.died = died
        super().__init__(f"The worker of rank {rank} of the RayExecutor {'died' if died else 'failed'}: {detail}")


@dataclass(frozen=True, kw_only=True)
class RaySettings:
    """How a RayExecutor starts its world (``RayExecutor.create_settings``).

    Attributes:
        timeout_s: how long the actors may take to start and the first view to form (the
            workers' rendezvous deadline).
        placement_group_timeout_s: how long the placement group may take to be placed.
        http_port: serve the coordinator's status page on this port (0: any free port); -1: none.
        env: more environment variables for every worker (any RINGSERVE_* setting).
        coordinator: more CoordinatorConfig fields (a token, TLS, heartbeat timing, ...).
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    http_port: int = -1
    env: Mapping[str, str] = field(default_factory=dict)
    coordinator: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "placement_group_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"RaySettings.{name} ({getattr(self, name)!r}) must be greater than zero.")
