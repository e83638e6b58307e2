"""The links from one rank to the others of its view: the gRPC stream (stream.py), the shared-memory
ring beside it (shared.py, handed over Unix sockets by fdpass.py), and the cache of peer channels
(channels.py)."""
