"""Elastic training: state that survives a changing world.

- ``state``: ``State``, ``ObjectState`` and the ``run`` wrapper (commit, restore, sync, resume);
- ``resume``: which member's commit the world adopts, and where a lost commit is found again;
- ``checkpoint``: durable commits, on disk or on the coordinator.

This package sits above the worker and the numpy API; the coordinator never imports it (the commit
records both sides share are ``ringserve.commits``).
"""

from typing import TYPE_CHECKING

from ringserve._lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers (ringserve._lazy)
    from ringserve.elastic.state import ObjectState, State, run

__all__ = ["ObjectState", "State", "run"]

__getattr__, __dir__ = exports(__name__, {"ObjectState": "ringserve.elastic.state", "State": "ringserve.elastic.state",
                                          "run": "ringserve.elastic.state"})
