"""A graceful leave costs the survivors nothing: a worker sent SIGTERM (`docker stop`, the
launcher's host discovery taking its slot away) leaves at its next commit, and the others go on
from that commit in the next view, with no restore, no step redone and none skipped.

As it was found: when two workers left at one commit (a host of two slots taken away), each left
by its own Leave after its drain, so the coordinator made a view per leaver; the survivors synced
in the first one, which still held the second leaver, and its departure failed that sync: "The
ring changed from view 3 to view 4 ... restoring the last commit". Now the ranks name the leavers
at the commit and rank 0 lets them all go in the one view that also admits any joiners.
"""

from __future__ import annotations

import signal
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.timeout(180)


def leave(tmp_path: Path, *, workers: int, leavers: int, steps: int = 120) -> tuple[list[dict], str, set[int]]:
    run = harness.start(tmp_path, workers=workers, min_np=1, steps=steps, pause_s=0.03, restart=False)
    run.wait_for_step(10, 90)
    harness.wait_for_world(run, workers, 60)  # every worker is in elastic.run (SIGTERM is its to handle)
    gone = set(run.workers()[:leavers])
    for pid in gone:
        run.signal("SIGTERM", signal.SIGTERM, pid)
    code, out = run.finish(150)
    assert code == 0, out[-4000:]
    return run.records(), out, gone


def check_no_rollback(records: list[dict], out: str, gone: set[int], steps: int = 120) -> None:
    assert "restoring the last commit" not in out, out[-4000:]
    assert out.count("leaving the world after a commit") == len(gone), out[-4000:]
    harness.check_invariants(records, steps)
    by_pid: dict[int, list[dict]] = {}
    for r in sorted(records, key=lambda r: r["time"]):
        by_pid.setdefault(r["pid"], []).append(r)
    survivors = set(by_pid) - gone
    assert survivors, "nobody survived to finish"
    for pid in survivors:
        seq = [r["step"] for r in by_pid[pid]]
        # No step redone, none skipped: the survivors never went back to a commit, and went on
        # from the leavers' last one.
        assert seq == list(range(seq[0], seq[-1] + 1)), f"survivor {pid} committed steps {seq}"
    last = {pid: by_pid[pid][-1] for pid in gone}
    assert all(r["step"] < steps for r in last.values()), last
    # The leavers all left at one commit, and the survivors' next view began right after it.
    leave_step = max(r["step"] for r in last.values())
    after = [r for pid in survivors for r in by_pid[pid] if r["step"] == leave_step + 1]
    assert after and all(r["view"] > max(x["view"] for x in last.values()) for r in after), (last, after)


def test_a_worker_sent_sigterm_leaves_at_a_commit_and_the_two_others_go_on_without_restoring(tmp_path: Path) -> None:
    records, out, gone = leave(tmp_path, workers=3, leavers=1)
    check_no_rollback(records, out, gone)


def test_two_workers_sent_sigterm_at_once_leave_in_one_view_and_the_survivors_never_restore(tmp_path: Path) -> None:
    records, out, gone = leave(tmp_path, workers=4, leavers=2)
    check_no_rollback(records, out, gone)
