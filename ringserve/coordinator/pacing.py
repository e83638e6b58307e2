"""How often workers heartbeat, and how long a failure view waits: pure functions of the settings
and the number of workers.

A heartbeat costs the coordinator a fixed amount of CPU (about 0.3 ms on a stream, see
benchmarks/coordinator_scale.py), so its load grows with the world: 2,000 workers beating once a
second keep more than half of its one core busy, and the queue that forms is the heartbeats'
latency. So the coordinator may stretch the interval it hands out as the world grows, keeping
the heartbeats at most ``max_heartbeats_per_s`` in all, but never past a third of the timeout:
a live worker then still has three beats in which to be heard before it would be declared
dead. Detection does not slow down: a worker is declared dead after ``heartbeat_timeout_s`` of
silence whatever the interval.

Example:
    ```python
    heartbeat_interval(1.0, 5.0, 1000.0, workers=2000)   # 5/3 s: 1,200 beats a second
    heartbeat_interval(1.0, 5.0, 1000.0, workers=800)    # 1.0 s, as configured
    ```
"""

from __future__ import annotations


def heartbeat_interval(interval_s: float, timeout_s: float, max_heartbeats_per_s: float, workers: int) -> float:
    """The interval for a world of ``workers``: ``interval_s``, stretched so that all of them
    together send at most ``max_heartbeats_per_s`` (0: never stretched), up to ``timeout_s / 3``;
    never shorter than ``interval_s``."""
    if max_heartbeats_per_s <= 0:
        return interval_s
    return max(interval_s, min(workers / max_heartbeats_per_s, timeout_s / 3))


def failure_window(interval_s: float, timeout_s: float) -> float:
    """How long a view without expired workers waits for the nearly silent ones to speak or
    expire too (see membership). Workers that died together sent their last heartbeats over one
    interval, and those arrived with latencies that vary under load: two intervals cover both.
    Only workers that missed two heartbeats count as nearly silent."""
    return max(0.0, min(2 * interval_s, timeout_s - 2 * interval_s))
