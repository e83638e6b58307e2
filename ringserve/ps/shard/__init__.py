"""A parameter-server shard: its servicer (service.py), its values (store.py), its checkpoints
(checkpoint.py) and its lifecycle (node.py: ``Shard``). Imports neither the worker nor the
coordinator; its process supervisor (``ParameterServer``) sits with the launchers
(ringserve/launch/shards.py)."""

from typing import TYPE_CHECKING

from ringserve._lazy import exports

if TYPE_CHECKING:  # the same name, for type checkers (ringserve._lazy)
    from ringserve.ps.shard.node import Shard

__all__ = ["Shard"]

__getattr__, __dir__ = exports(__name__, {"Shard": "ringserve.ps.shard.node"})
