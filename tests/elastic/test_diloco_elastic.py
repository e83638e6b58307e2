"""DiLoCo under elastic training (tests/elastic/diloco_worker.py, ringserve.torch.DiLoCo kept in a
TorchState): a worker killed in the middle of a round costs the survivors at most that round; a
worker that joins in the middle of a round is admitted at the round's end with the global copy,
the outer momentum and the step count; the global copy stays the same bytes on every rank of every
view (harness.check_invariants compares the sha of each commit across the ranks of its view).

The join and the fragments cases are slow-marked (40 s and 30 s here):
``.venv/bin/python -m pytest -p no:cacheprovider -m slow tests/elastic/test_diloco_elastic.py``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.timeout(240)

DILOCO_WORKER = str(Path(__file__).with_name("diloco_worker.py"))
H = 5
# A dead worker is found by its peers' broken streams at once; the heartbeat timeout only judges
# the living, which a loaded 2-core machine can hold off their heartbeats for seconds.
HEARTBEAT_TIMEOUT_S = 10.0


def records_after(records: list[dict], at: float) -> list[dict]:
    return [r for r in records if r["time"] > at]


def test_a_worker_killed_mid_round_costs_the_survivors_at_most_that_round(tmp_path: Path) -> None:
    steps = 60
    run = harness.start(tmp_path, workers=3, min_np=2, steps=steps, pause_s=0.04, restart=False,
                        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, worker=DILOCO_WORKER, env={"DILOCO_SYNC_EVERY": str(H)})
    run.wait_for_step(3 * H, 120)
    harness.wait_for_world(run, 3, 60)
    time.sleep(0.04 * H / 2)  # into the next round
    before = run.records()
    committed = max(r["step"] for r in before)
    killed_at = time.time()
    run.signal("kill -9", signal.SIGKILL, run.workers()[-1])
    code, out = run.finish(180)
    assert code == 0, out[-4000:]
    records = run.records()
    harness.check_invariants(records, steps)
    assert all(r["step"] % H == 0 for r in records), "a commit between outer steps"
    # The survivors went back at most to the last commit before the kill: the round it broke.
    after = records_after(records, killed_at)
    assert after and min(r["step"] for r in after) >= committed, (committed, sorted({r["step"] for r in after}))
    assert len({r["view"] for r in after}) >= 1 and max(r["view"] for r in after) > max(r["view"] for r in before)


@pytest.mark.slow
def test_a_worker_that_joins_mid_round_takes_the_global_copy_and_outer_momentum_at_the_rounds_end(
    tmp_path: Path,
) -> None:
    steps = 60
    env = {"DILOCO_SYNC_EVERY": str(H), "DILOCO_MIN_SIZE": "3"}  # on until the joiner is in
    run = harness.start(tmp_path, workers=2, min_np=2, max_np=3, steps=steps, pause_s=0.04, restart=False,
                        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, worker=DILOCO_WORKER, env=env)
    address = harness.coordinator_address(run)
    run.wait_for_step(3 * H, 120)
    joiner = harness.start_worker(address, run.log, steps, 0.04, worker=DILOCO_WORKER,
                                  env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [
                                      str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))})
    try:
        code, out = run.finish(180)
        joiner_out, _ = joiner.communicate(timeout=60)
    finally:
        if joiner.poll() is None:
            joiner.kill()
    assert code == 0, out[-3000:]
    assert joiner.returncode == 0, joiner_out.decode()[-3000:]
    records = run.records()
    last = max(r["step"] for r in records)
    harness.check_invariants(records, last)
    joined = [r for r in records if r["pid"] == joiner.pid]
    assert joined, "the joiner never committed"
    first = min(joined, key=lambda r: r["step"])
    assert first["step"] > 3 * H and first["step"] % H == 0
    # In the view it joined, its global copy and momentum are the others' (the same sha at the same step).
    peers = [r for r in records if r["view"] == first["view"] and r["step"] == first["step"] and r["pid"] != joiner.pid]
    assert peers and all(p["sha"] == first["sha"] for p in peers)
    assert f"finished at step {last}" in joiner_out.decode()
    assert max(r["step"] for r in joined) == last


@pytest.mark.slow
def test_with_fragments_in_flight_at_commits_a_kill_leaves_every_view_with_one_global_copy(tmp_path: Path) -> None:
    """Commits after every inner step, with a fragment's sync in flight at half of them: a sync
    that started in a view that has ended is dropped on every rank alike."""
    steps = 48
    run = harness.start(tmp_path, workers=3, min_np=2, steps=steps, pause_s=0.04, restart=False,
                        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, worker=DILOCO_WORKER,
                        env={"DILOCO_SYNC_EVERY": "4", "DILOCO_FRAGMENTS": "2", "DILOCO_DELAY": "1",
                             "DILOCO_COMMIT": "step"})
    run.wait_for_step(10, 120)
    harness.wait_for_world(run, 3, 60)
    run.signal("kill -9", signal.SIGKILL, run.workers()[-1])
    code, out = run.finish(180)
    assert code == 0, out[-4000:]
    harness.check_invariants(records := run.records(), steps)
    harness.check_no_silent_regression(records, out)
