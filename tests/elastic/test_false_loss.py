"""No false alarm: a StateLostError only when every worker that held the job's last commit is
really gone. Holders that the coordinator declared dead while they were alive (stopped, or starved
on a loaded machine: their heartbeats came too late) are waited for, up to holder_wait_s, and the
state comes from them once they are back; holders whose address refuses connections are gone at
once (test_state_loss.py); holders silent past the bound are declared lost, with the reason.

As it was found: under a load average of 60, live holders missed their heartbeats for longer than
the timeout and were dropped; the view left behind held only workers without the state, raised
StateLostError, and `ringserve run` ended the job with 65 while the holders were alive. Here
SIGSTOP stands for the starvation, which makes it certain.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from pathlib import Path

import harness
import pytest

from ringserve.errors import STATE_LOST_EXIT_CODE

pytestmark = pytest.mark.timeout(180)

WAITING = "waiting up to"  # the fresh view's rank 0 found the mark held by no member, and waits


def stop_every_holder_while_a_fresh_worker_syncs(tmp_path: Path, steps: int, env: dict[str, str] | None = None,
                                                 ) -> tuple[harness.Run, list[int], int]:
    """Three workers train (min 1); one is killed and restarted; while the restarted one is in the
    view without the state, the two holders are stopped. The coordinator declares them dead (2 s),
    and the restarted worker is left alone in a view, holding nothing.

    Returns the run (its output followed), the stopped holders, and the furthest step committed.
    """
    hold = tmp_path / "hold"
    run = harness.start(tmp_path, workers=3, min_np=1, steps=steps, pause_s=0.03,
                        env={"HOLD_FRESH_SYNC": str(hold), **(env or {})})
    run.follow()
    run.wait_for_step(10, 120)
    harness.wait_for_world(run, 3, 60)
    first = set(run.workers())
    run.signal("kill -9", signal.SIGKILL)
    fresh = harness.wait_for_fresh_syncs(hold, 1, 60, ignore=first)
    holders = [pid for pid in run.workers() if pid not in fresh]
    assert len(holders) == 2, f"expected the two holders besides the fresh worker {fresh}: {run.workers()}"
    before = max(r["step"] for r in run.records())
    for pid in holders:
        run.signal("SIGSTOP", signal.SIGSTOP, pid)
    Path(f"{hold}.go").touch()
    return run, holders, before


def test_holders_declared_dead_while_stopped_are_waited_for_and_supply_the_state(tmp_path: Path) -> None:
    run, holders, before = stop_every_holder_while_a_fresh_worker_syncs(tmp_path, steps=150)
    try:
        line = run.wait_for_line(WAITING, 60)
    finally:
        for pid in holders:
            os.kill(pid, signal.SIGCONT)
    assert f"holds commit {before}" in line, line
    code, out = run.finish(150)
    assert code == 0, out[-4000:]
    assert "StateLostError" not in out, out[-4000:]
    assert "its holder is back" in out, out[-4000:]
    records = run.records()
    harness.check_invariants(records, 150)
    assert harness.check_no_silent_regression(records, out) == []
    # The job went on from the holders' commit, not from a fresh process's step 0.
    stopped_at = run.faults[-1][0]
    assert min(r["step"] for r in records if r["time"] > stopped_at) >= before


def test_holders_silent_past_holder_wait_s_are_declared_lost_with_the_reason(tmp_path: Path) -> None:
    run, holders, before = stop_every_holder_while_a_fresh_worker_syncs(
        tmp_path, steps=100_000, env={"RINGSERVE_HOLDER_WAIT_S": "3"})
    try:
        run.wait_for_line(WAITING, 60)
        started = time.time()
        code, out = run.finish(90)
    finally:
        for pid in holders:
            with contextlib.suppress(ProcessLookupError):  # the launcher stopped them at the end
                os.kill(pid, signal.SIGCONT)
    assert code == STATE_LOST_EXIT_CODE, out[-4000:]
    assert re.search(rf"every worker holding commit {before} died .*no holder came back within 3 s "
                     r"\(holder_wait_s\): worker \w+ at [\d.:]+ silent \(no answer\); worker \w+ at [\d.:]+ silent", out), out[-4000:]
    # The bound is kept: 3 s from the first look, plus a look's deadline (a heartbeat interval).
    assert time.time() - started < 30


def commit_mark(address: str) -> int:
    """The job's mark as the coordinator at ``address`` knows it now."""
    import grpc

    from ringserve._proto import coordinator_pb2 as pb
    from ringserve._proto import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        mark = pb_grpc.CoordinatorStub(channel).CommitMark(pb.CommitMarkRequest(worker_id=""), timeout=10)
    return int(mark.step) if mark.known else -1


def test_the_mark_never_trails_the_world_by_more_than_one_commit(tmp_path: Path) -> None:
    # Else a world stopped between heartbeats leaves a mark that names an older commit as the
    # newest, and the next world goes back to it with no error (found: 24 steps redone).
    run = harness.start(tmp_path, workers=2, min_np=2, steps=100_000, pause_s=0.002, restart=False)
    run.follow()
    address = run.wait_for_line("coordinator at ", 30).split("coordinator at ", 1)[1].split(";", 1)[0].strip()
    run.wait_for_step(20, 90)
    harness.wait_for_world(run, 2, 60)
    rng = random.Random(0)
    lags = []
    try:
        for _ in range(6):
            time.sleep(rng.uniform(0.2, 0.6))
            pids = run.workers()
            for pid in pids:
                run.signal("SIGSTOP", signal.SIGSTOP, pid)
            time.sleep(0.3)  # what was sent before the stop has landed
            lags.append(max(r["step"] for r in run.records()) - commit_mark(address))
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    finally:
        for pid in run.workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGTERM)
        run.finish(60)
    assert max(lags) <= 1, f"the world was ahead of the mark by {lags} commits"


def starve_in_turns(run: harness.Run, rng: random.Random, turns: int) -> int:
    """Stops one half of the four workers, then the other, for longer than the heartbeat timeout
    each time, as a loaded machine starves processes in bursts: each half comes back holding an
    older commit than the half that went on, and is admitted while that half is being dropped.
    Returns the number of stops."""
    stops = 0
    for turn in range(turns):
        live = sorted(run.workers())
        if run.launcher.poll() is not None or len(live) < 4:
            break
        pair = live[:2] if turn % 2 == 0 else live[2:]
        for pid in pair:
            run.signal("SIGSTOP", signal.SIGSTOP, pid)
        stops += 1
        time.sleep(rng.uniform(2.5, 4.0))  # heartbeat timeout 2 s
        for pid in pair:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        time.sleep(rng.uniform(0.0, 0.5))
    return stops


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(4))
def test_one_worker_raises_while_halves_of_the_world_are_starved_in_turns_and_nothing_is_lost(
    tmp_path: Path, seed: int
) -> None:
    # test_chaos's one-raise run, as it failed at a load average of 60 (StateLostError naming two
    # live holders; on main 3 of 3 seeds end so here), with the starvation made deliberate.
    rng = random.Random(seed)
    run = harness.start(tmp_path, steps=700, pause_s=0.02, fault="raise@30")
    run.follow()
    run.wait_for_step(5, 90)
    harness.wait_for_world(run, 4, 60)
    stops = starve_in_turns(run, rng, turns=8)
    code, out = run.finish(400)
    assert code == 0, out[-4000:]
    assert "StateLostError" not in out and "injected fault at step 30" in out, out[-4000:]
    records = run.records()
    harness.check_invariants(records, 700)
    assert harness.check_no_silent_regression(records, out) == []
    print(f"\nstarved in turns (seed {seed}): {stops} stops, {out.count(WAITING)} waits for holders, "
          f"{out.count('its holder is back')} readmitted, {len(records)} commits")
