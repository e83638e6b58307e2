"""The TCP payload lane: a link's frames on a plain TCP connection beside its stream (outbound.py
sends, inbound.py receives, server.py takes the connections on the worker's one port), framed by
frames.py, sealed under TLS by seal.py, on the sockets and threads of sockets.py and threads.py."""
