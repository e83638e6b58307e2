"""Elastic training: state that survives a changing world.

- ``state``: ``State``, ``ObjectState`` and the ``run`` wrapper (commit, restore, sync, resume);
- ``resume``: which member's commit the world adopts, and where a lost commit is found again;
- ``checkpoint``: durable commits, on disk or on the coordinator.

This package sits above the worker and the numpy API; the coordinator never imports it (the commit
records both sides share are ``ringserve.commits``).
"""

from __future__ import annotations

from ringserve.elastic.state import ObjectState, State, run

__all__ = ["ObjectState", "State", "run"]
