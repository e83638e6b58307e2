"""After an op of a group times out, every later op of that group fails on every rank, as gloo's do.

A world of two real processes (the coordinator in the test): ``g = new_group([0, 1],
timeout=1 s)``. Rank 0's barrier on ``g`` times out while rank 1 is away; rank 1 comes back and
makes the same barrier, which must fail at once rather than succeed on the frames rank 0 left
behind (before, it succeeded, the ranks' op counters fell out of step, and the next ops timed out
or failed with MismatchError). Then every op of ``g`` fails at once on both ranks with
DistBackendError naming the op that timed out, the rank and the group's timeout, while the
default group, a group made before and one made after go on giving the right results.

The ranks run this very file as their script (``rank_main``), writing what they saw to
OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_worlds import run_dist

import ringserve.torch.distributed  # noqa: F401

GROUP_TIMEOUT_S = 1.0
AT_ONCE_S = 0.5  # an op of the broken group fails well within this (its timeout is GROUP_TIMEOUT_S)


def rank_main(out: Path) -> None:
    """One rank of the world (run as ``python this_file.py OUT_DIR``)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ringserve", rank=rank, world_size=size)
    other = dist.new_group([0, 1])
    g = dist.new_group([0, 1], timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    seen: dict[str, Any] = {}

    def attempt(name: str, op: Callable[[], Any]) -> None:
        started = time.monotonic()
        try:
            value = op()
            seen[name] = {"ok": True, "value": value, "after_s": time.monotonic() - started}
        except Exception as exc:
            seen[name] = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                          "cause": type(exc.__cause__).__name__, "after_s": time.monotonic() - started}

    def all_reduce(group: Any) -> list[float]:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=group)
        return t.tolist()

    attempt("before", lambda: all_reduce(g))
    signal = out / "rank0.timed_out"
    if rank == 0:
        attempt("timed_out", lambda: dist.barrier(group=g))  # rank 1 is away: this times out
        signal.write_text("")
    else:
        while not signal.exists():  # away until rank 0's barrier has timed out
            time.sleep(0.05)
        time.sleep(1.0)  # and a little more: the notice of it is on its way, over loopback
        attempt("late", lambda: dist.barrier(group=g))  # the same barrier, late: it must not succeed

    def send_or_recv() -> None:
        t = torch.zeros(4)
        if rank == 0:
            dist.send(t, dst=1, group=g)
        else:
            dist.recv(t, src=0, group=g)

    def gathered() -> list[list[float]]:
        outputs = [torch.zeros(2) for _ in range(size)]
        dist.all_gather(outputs, torch.full((2,), float(rank)), group=g)
        return [o.tolist() for o in outputs]

    attempt("after.barrier", lambda: dist.barrier(group=g))
    attempt("after.all_reduce", lambda: all_reduce(g))
    attempt("after.all_reduce_async", lambda: dist.all_reduce(torch.ones(3), group=g, async_op=True).wait())
    attempt("after.broadcast", lambda: dist.broadcast(torch.ones(3), src=0, group=g))
    attempt("after.all_gather", gathered)
    attempt("after.p2p", send_or_recv)
    attempt("after.barrier_again", lambda: dist.barrier(group=g))
    attempt("default", lambda: all_reduce(None))
    attempt("other", lambda: all_reduce(other))
    attempt("new", lambda: all_reduce(dist.new_group([0, 1], timeout=timedelta(seconds=30))))
    attempt("default_again", lambda: all_reduce(None))
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def _broken_by_rank_0s_barrier(seen: dict[str, Any], rank: int, name: str) -> None:
    """``seen[name]`` failed at once, with DistBackendError naming what broke the group."""
    got = seen[name]
    assert not got["ok"], f"rank {rank}: {name} on the group broken by a timeout succeeded: {got}"
    assert got["type"] == "DistBackendError" and got["cause"] == "GroupTimedOutError", (rank, name, got)
    message = got["message"]
    assert message.startswith("ringserve: ") and "on a process group that a timeout broke" in message, (rank, got)
    assert f"barrier timed out on rank 0 of the group after {GROUP_TIMEOUT_S:g} s, the group's timeout" in message, got
    assert "torch.group." in message and "make a new group" in message, (rank, got)
    assert got["after_s"] < AT_ONCE_S, f"rank {rank}: {name} took {got['after_s']:.2f} s to fail: {got}"


@pytest.mark.timeout(150)
def test_a_timeout_breaks_its_group_on_every_rank_and_the_other_groups_go_on(tmp_path: Path) -> None:
    run_dist(Path(__file__), 2, tmp_path, timeout_s=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, seen in enumerate(ranks):
        assert seen["before"]["ok"] and seen["before"]["value"] == [3.0] * 3, (r, seen["before"])

    timed_out = ranks[0]["timed_out"]
    assert not timed_out["ok"] and timed_out["type"] == "DistBackendError", timed_out
    assert timed_out["cause"] == "CollectiveTimeoutError" and "Timed out" in timed_out["message"], timed_out
    assert GROUP_TIMEOUT_S - 0.1 < timed_out["after_s"] < GROUP_TIMEOUT_S + 5.0, timed_out
    # The late rank's barrier fails too (it used to succeed, and the ranks' op counts parted).
    _broken_by_rank_0s_barrier(ranks[1], 1, "late")

    for r, seen in enumerate(ranks):
        for name in [n for n in seen if n.startswith("after.")]:
            _broken_by_rank_0s_barrier(seen, r, name)
        for name in ("default", "other", "new", "default_again"):
            assert seen[name]["ok"] and seen[name]["value"] == [3.0] * 3, (r, name, seen[name])


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
