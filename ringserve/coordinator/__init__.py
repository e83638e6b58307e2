"""The coordinator: membership, numbered views, heartbeats and the parameter store."""

from typing import TYPE_CHECKING

from ringserve._lazy import exports

if TYPE_CHECKING:  # the same name, for type checkers (ringserve._lazy)
    from ringserve.coordinator.server import Coordinator

__all__ = ["Coordinator"]

__getattr__, __dir__ = exports(__name__, {"Coordinator": "ringserve.coordinator.server"})
