"""Parameter-server mode: sharded asyncio gRPC parameter servers, and their clients.

The third service beside the coordinator and the worker (see docs/guide/parameter-server.md). S
shards each hold about 1/S of a model's bytes (layout.py), register with the coordinator, which
is the directory workers find them in, apply a server-side optimizer (SGD, momentum, Adam;
optim.py) to the gradients workers push, and serve the values workers pull, in one of four modes
(rules.py): ``sync``, ``async``, ``ssp`` (bounded staleness) and ``average`` (federated averaging).

- Shards: ``ringserve ps --shards S``, ``ringserve.ParameterServer(...)``, or one ``Shard`` in a loop.
  The shard side (``shard/``: the servicer, the store, checkpoints) imports neither the worker
  nor the coordinator, and a shard process loads no more.
- Shared by both sides: the layout (layout.py), the job (jobs.py), the modes' rules (rules.py),
  the optimizers (optim.py), and how a broken stream is told from a verdict (verdicts.py).
- Clients (``client/``): ``Client`` (synchronous, numpy: client/sync.py), ``AsyncClient`` (asyncio:
  client/aio.py, with its connections to the shards in client/shards.py), and for torch
  ``ringserve.torch.ps.ParameterServerOptimizer``.

Example:
    ```python
    import ringserve as rs
    from ringserve.ps import Client, Optimizer

    rs.init()                                    # a worker: its view makes it a member
    ps = Client({"w": w}, mode="sync", optimizer=Optimizer(kind="momentum", lr=0.1, momentum=0.9))
    values = ps.pull()
    ps.push({"w": grad})
    ```
"""

from typing import TYPE_CHECKING

from ringserve._lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers: each is imported when first read (ringserve._lazy)
    from ringserve.launch.shards import ParameterServer
    from ringserve.ps.client.aio import AsyncClient
    from ringserve.ps.client.sync import Client
    from ringserve.ps.layout import Layout, Piece, TensorSpec, partition
    from ringserve.ps.optim import Optimizer
    from ringserve.ps.rules import MODES
    from ringserve.ps.shard.node import Shard

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

__getattr__, __dir__ = exports(__name__, {
    "ParameterServer": "ringserve.launch.shards",
    "AsyncClient": "ringserve.ps.client.aio",
    "Client": "ringserve.ps.client.sync",
    "Layout": "ringserve.ps.layout",
    "Piece": "ringserve.ps.layout",
    "TensorSpec": "ringserve.ps.layout",
    "partition": "ringserve.ps.layout",
    "Optimizer": "ringserve.ps.optim",
    "MODES": "ringserve.ps.rules",
    "Shard": "ringserve.ps.shard.node",
})
