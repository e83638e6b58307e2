"""Horovod's timeline API: ``hvd.start_timeline(path)`` and ``hvd.stop_timeline()``.

The trace is ringserve's own Chrome-trace timeline (see ringserve.observe, also written for the
whole run when RINGSERVE_TIMELINE is set), with the names Horovod's timeline uses, so that tools
and habits built on Horovod's read it:

- each collective's row is named as Horovod names a tensor: ``allreduce.<name>``;
- the wait for the other ranks is ``NEGOTIATE_ALLREDUCE`` (``NEGOTIATE_BROADCAST``, ...), the whole
  collective ``ALLREDUCE``, and its phases ``REDUCE_SCATTER``, ``ALLGATHER``, ``BROADCAST``;
- the file starts with a ``start_time_since_epoch_in_micros`` event;
- with ``mark_cycles``, a ``CYCLE_START`` instant marks the start of each collective. Horovod
  marks each cycle of its background loop; ringserve has no such loop (each collective runs as
  soon as it is called), so the start of each collective is the nearest equivalent.

Only this rank's collectives are written, to ``path`` as given on every rank (Horovod writes
only rank 0's file; here each rank writes its own, so give each rank its own path, or use
``{rank}`` in it).
"""

from __future__ import annotations

import time
from typing import Any

from ringserve.observe import Timeline
from ringserve.torch import basics


class HorovodTimeline(Timeline):
    """A Timeline whose events carry Horovod's names (see the module docstring)."""

    def __init__(self, path: str, rank: int, *, mark_cycles: bool) -> None:
        super().__init__(path, rank)
        self.mark_cycles = mark_cycles
        with self._lock:
            self._event({"name": "start_time_since_epoch_in_micros", "ph": "M", "pid": rank,
                         "args": {"value": int(time.time() * 1e6)}})

    def complete(self, name: str, category: str, start: float, stop: float, args: dict[str, Any], lane: str) -> None:
        kind = category.replace("_", "") or "collective"  # reduce_scatter -> reducescatter, as Horovod
        base = lane.rsplit("#", 1)[0] or "noname"
        row = f"{kind}.{base}"
        if name == "negotiate":
            event = f"NEGOTIATE_{kind.upper()}"
            if self.mark_cycles:
                self._instant("CYCLE_START", start, row)
        elif name.startswith(f"{category} "):  # the whole collective
            event = kind.upper()
        else:
            event = name.upper()
        super().complete(event, kind, start, stop, args, lane=row)

    def _instant(self, name: str, at: float, row: str) -> None:
        with self._lock:
            if self._file is None:
                return
            self._event({"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": self._lane(row),
                         "ts": round(self._wall0_us + (at - self._origin) * 1e6, 1)})


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing this rank's collectives to ``file_path`` (Horovod's ``hvd.start_timeline``).

    A timeline already being written is stopped first and its file closed, whether start_timeline()
    or RINGSERVE_TIMELINE started it; ``{rank}`` in the path is replaced by this rank. The
    collectives already in flight are not written.

    Args:
        file_path: the trace to write (Chrome trace JSON).
        mark_cycles: mark the start of each collective with a CYCLE_START event.
    """
    rank = basics.rank()
    timeline = HorovodTimeline(file_path.replace("{rank}", str(rank)), rank, mark_cycles=mark_cycles)
    _swap(timeline)


def stop_timeline() -> None:
    """Stops writing the timeline and closes its file (Horovod's ``hvd.stop_timeline``)."""
    _swap(None)


def _swap(timeline: Timeline | None) -> None:
    try:
        previous = basics.wait(basics.submit(lambda w: w.set_timeline(timeline)))
    except BaseException:
        if timeline is not None:
            timeline.close()
        raise
    if previous is not None:
        previous.close()
