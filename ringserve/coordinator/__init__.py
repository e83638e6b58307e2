"""The coordinator: membership, numbered views, heartbeats and the parameter store."""

from ringserve.coordinator.server import Coordinator

__all__ = ["Coordinator"]
