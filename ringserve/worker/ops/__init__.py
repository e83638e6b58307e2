"""Collectives: which program each call runs over which session (allreduce, allgather, process sets, ...)."""
