"""The path of one allreduce through the code, before its programs run: how many stops, in how
many files, how often it climbs back up a layer or returns to a file it left.

    python benchmarks/descent.py            # this tree
    PYTHONPATH=/path/to/other/checkout python /path/to/other/checkout/benchmarks/descent.py

Four ranks on two hosts (two each) run one allreduce of 64 Ki float32 in one event loop, over
in-memory links (ringserve.testing.memlink: the shipped planes, sessions and executor), under three
settings: the ring, ``auto`` flat, and by host (RINGSERVE_HIERARCHICAL=1, auto's algorithms, a
WAN's link figures). Rank 0's call is traced from ``worker/ops/collectives.allreduce`` with
``sys.setprofile``: every function of ringserve entered for the first time (a coroutine's resumes
are not new stops), outside the executor's run of a program (what runs the steps, the same for
every plan), and outside pure computations (``leaf``: what the cost model, the topologies, the
ring's arithmetic and the planner call inside themselves is one stop, where they were entered). A stop is an entry into another file than the last one's; a climb, an entry into a
higher layer (worker/ops above worker/dataplane above the package's ground modules); a return, a
stop in a file the path had already left. Only the first call is traced (plans and measures are
remembered after it); the figures are given, so no measure runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import pathlib
import sys
import types
from typing import Any

import numpy as np

from ringserve.errors import RingChangedError
from ringserve.observe import Counters
from ringserve.selection import WAN_LINKS
from ringserve.testing.memlink import MemoryLink
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.ops import collectives

PACKAGE = pathlib.Path(collectives.__file__).resolve().parents[2]
HOSTS = (0, 0, 1, 1)
SETTINGS = {"ring": ("ring", "0"), "auto, flat": ("auto", "0"), "by host": ("auto", "1")}
traced: contextvars.ContextVar[bool] = contextvars.ContextVar("traced", default=False)
RUNS = ("run_stages",)
ENTRY = collectives.allreduce.__code__  # the executor's: running a program is not planning it


def layer(path: str) -> int:
    rel = pathlib.Path(path).relative_to(PACKAGE).as_posix()
    if rel.startswith("worker/ops/"):
        return 3
    if rel.startswith("worker/"):
        return 2
    return 1


def leaf(path: str) -> bool:
    """A pure computation, whose inside is not the path's: the ground modules (the cost model, the
    topologies, the ring's arithmetic), and the planner."""
    return layer(path) == 1 or path.endswith("worker/ops/planner.py")


class Tracer:
    def __init__(self) -> None:
        self.seen: list[types.FrameType] = []
        self.files: list[str] = []

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or not traced.get():
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE)) or any(f is frame for f in self.seen):
            return
        self.seen.append(frame)
        if not self.within(frame):
            return  # before the call, or in a task it started (a link's pump)
        back = frame.f_back
        while back is not None:
            code = back.f_code
            if code.co_name in RUNS and code.co_filename.endswith("executor.py"):
                return
            if code.co_filename.startswith(str(PACKAGE)) and leaf(code.co_filename):
                return  # inside a pure computation: one stop, where it was entered
            back = back.f_back
        self.files.append(path)

    @staticmethod
    def within(frame: types.FrameType) -> bool:
        back: types.FrameType | None = frame
        while back is not None:
            if back.f_code is ENTRY:
                return True
            back = back.f_back
        return False

    def summary(self) -> dict[str, int]:
        stops = [f for i, f in enumerate(self.files) if i == 0 or f != self.files[i - 1]]
        left: set[str] = set()
        returns = climbs = 0
        for i, f in enumerate(stops):
            if f in left:
                returns += 1
            if i and layer(f) > layer(stops[i - 1]):
                climbs += 1
            if i:
                left.add(stops[i - 1])
        return {"stops": len(stops), "files": len(set(stops)), "climbs": climbs, "returns": returns}


async def one(algorithm: str, hierarchical: str) -> dict[str, int]:
    world = len(HOSTS)
    addresses = tuple(f"sim-{r}" for r in range(world))
    planes: list[Plane] = []
    for r in range(world):
        counters = Counters()
        place = Place(view_id=1, rank=r, size=world, addresses=addresses, hosts=HOSTS)
        planes.append(Plane(place, counters, 1.0, algorithm=algorithm, hierarchical=hierarchical, links=WAN_LINKS,
                            connect=lambda to, counters=counters: MemoryLink(lambda: planes[to], counters)))
    tracer = Tracer()
    x = np.ones(64 << 10, dtype=np.float32)

    async def rank(r: int) -> None:
        if r == 0:
            traced.set(True)
        await collectives.allreduce(planes[r].session(), x, op="sum", name="g", chunk_bytes=1 << 20, timeout_s=20)

    sys.setprofile(tracer)
    try:
        async with asyncio.TaskGroup() as group:
            for r in range(world):
                group.create_task(rank(r))
    finally:
        sys.setprofile(None)
        for p in planes:
            p.close(RingChangedError(1, 2, "the measure is over"))
    return tracer.summary()


def main() -> None:
    print("| setting | stops | files | climbs back up | returns to a file left |")
    print("|---|---|---|---|---|")
    for name, (algorithm, hierarchical) in SETTINGS.items():
        s = asyncio.run(one(algorithm, hierarchical))
        print(f"| {name} | {s['stops']} | {s['files']} | {s['climbs']} | {s['returns']} |")


if __name__ == "__main__":
    main()
