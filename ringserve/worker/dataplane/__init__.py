"""The worker's data plane: programs, the executor, planes, sessions, links and lanes, the peer servicer."""
