"""The worker runtime: peer server, ring sessions per view, and the collectives."""
