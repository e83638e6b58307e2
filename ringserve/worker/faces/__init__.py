"""The worker's public faces: its collectives (collectives.py) and what elastic training asks of
it (elastic.py), each an object of its own over the worker's node (ringserve.worker.node)."""
