"""The parameter server's clients: ``AsyncClient`` (aio.py, asyncio, any framework), its connections
to the shards (shards.py), and ``Client`` (sync.py: synchronous, numpy, a worker of the numpy
facade's context). Re-exported by ``ringserve.ps``."""

from typing import TYPE_CHECKING

from ringserve._lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers (ringserve._lazy)
    from ringserve.ps.client.aio import AsyncClient
    from ringserve.ps.client.sync import Client

__all__ = ["AsyncClient", "Client"]

__getattr__, __dir__ = exports(__name__, {"AsyncClient": "ringserve.ps.client.aio", "Client": "ringserve.ps.client.sync"})
