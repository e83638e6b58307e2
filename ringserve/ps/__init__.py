"""Parameter-server mode: sharded asyncio gRPC parameter servers, and their clients.

The third service beside the coordinator and the worker (see ARCHITECTURE.md, "Version 3"). S
shards each hold about 1/S of a model's bytes (layout.py), register with the coordinator, which
is the directory workers find them in, apply a server-side optimizer (SGD, momentum, Adam;
optim.py) to the gradients workers push, and serve the values workers pull, in one of four modes
(rules.py): ``sync``, ``async``, ``ssp`` (bounded staleness) and ``average`` (federated averaging).

- Shards: ``ringserve ps --shards S``, ``ringserve.ParameterServer(...)``, or one ``Shard`` in a loop.
- Clients: ``Client`` (synchronous, numpy), ``AsyncClient`` (asyncio), and for torch
  ``ringserve.torch.ps.ParameterServerOptimizer``.

Example::

    import ringserve as rs
    from ringserve.ps import Client, Optimizer

    rs.init()                                    # a worker: its view makes it a member
    ps = Client({"w": w}, mode="sync", optimizer=Optimizer(kind="momentum", lr=0.1, momentum=0.9))
    values = ps.pull()
    ps.push({"w": grad})
"""

from ringserve.ps.api import Client
from ringserve.ps.client import AsyncClient
from ringserve.ps.layout import Layout, Piece, TensorSpec, partition
from ringserve.ps.optim import Optimizer
from ringserve.ps.rules import MODES
from ringserve.ps.server import ParameterServer
from ringserve.ps.shard import Shard

__all__ = [
    "MODES",
    "AsyncClient",
    "Client",
    "Layout",
    "Optimizer",
    "ParameterServer",
    "Piece",
    "Shard",
    "TensorSpec",
    "partition",
]
