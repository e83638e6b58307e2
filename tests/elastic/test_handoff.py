"""A joiner gets the state point to point from the sync's root, while the members go on.

When a worker comes into a running torch world, the members already hold the commit the view
takes: only the joiner needs it, and the root sends it to the joiner alone (TorchState.take's
handoff) instead of a broadcast that every member waits in. These tests run the torch loop of the
chaos tests: a joiner comes in and ends with the members' parameters; forced, the root dies
before it sends anything: the joiner's receive fails, the others form a view without the root,
and the joiner takes the state from the new root; and a joiner admitted at the last commit gets
the state before the members, done, leave (the root waits for its word that it has it).
"""

from __future__ import annotations

import re
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.timeout(180)

STEPS = 500


def run_with_joiner(tmp_path: Path, env: dict[str, str]) -> tuple[str, list[dict], int]:
    run = harness.start(tmp_path, workers=2, steps=STEPS, pause_s=0.02, min_np=2, max_np=3,
                        worker=harness.TORCH_WORKER, env=env)
    joiner = None
    try:
        address = harness.coordinator_address(run)
        run.wait_for_step(20, 60)
        joiner = harness.start_worker(address, run.log, STEPS, 0.02, worker=harness.TORCH_WORKER, env=env,
                                      output=tmp_path / "joiner.log")
        code, out = run.finish(150)
        assert joiner.wait(30) == 0, (tmp_path / "joiner.log").read_text()[-3000:]
    finally:
        for p in (joiner, run.launcher):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert code == 0, out[-4000:]
    return out + (tmp_path / "joiner.log").read_text(), run.records(), joiner.pid


def test_a_joiner_takes_the_members_state_from_the_root_alone(tmp_path: Path) -> None:
    out, records, joiner = run_with_joiner(tmp_path, {})
    harness.check_invariants(records, STEPS)  # its commits carry the members' parameters
    first = min(r["step"] for r in records if r["pid"] == joiner)
    assert first < STEPS - 10, f"the joiner was admitted only at step {first}"
    broadcasts = [int(n) for n in re.findall(r"finished at step \d+ after \d+ allreduces and (\d+) broadcasts", out)]
    assert len(broadcasts) == 3, out[-4000:]
    # The members broadcast only at their first sync, of fresh processes; the joiner never did.
    assert broadcasts[-1] == 0 and all(n > 0 for n in broadcasts[:2]), broadcasts


def test_a_root_that_dies_before_its_handoff_leaves_the_joiner_to_take_the_state_from_the_next(tmp_path: Path) -> None:
    marker = tmp_path / "died"
    out, records, joiner = run_with_joiner(tmp_path, {"DIE_AT_HANDOFF": str(marker)})
    assert marker.exists() and "dies before handing the state to ranks" in out, out[-4000:]
    # The joiner's receive failed with a recoverable error (the root's stream ended, or the view
    # without the root came first, by the race), and it restored and synced again.
    joiner_log = (tmp_path / "joiner.log").read_text()
    assert re.search(r"rank \d+ view \d+: .*; restoring the last commit", joiner_log), joiner_log[-4000:]
    harness.check_invariants(records, STEPS)
    assert any(r["pid"] == joiner for r in records), "the joiner never committed"


def test_a_joiner_admitted_at_the_last_commit_has_the_state_before_the_members_leave(tmp_path: Path) -> None:
    run = harness.start(tmp_path, workers=2, steps=40, pause_s=0.02, min_np=2, max_np=3, restart=False,
                        worker=harness.TORCH_WORKER, env={"HOLD_FOR_JOINER": "1"})
    joiner = None
    try:
        address = harness.coordinator_address(run)
        run.wait_for_step(38, 60)
        joiner = harness.start_worker(address, run.log, 40, 0.02, worker=harness.TORCH_WORKER,
                                      output=tmp_path / "joiner.log")
        code, out = run.finish(120)
        joiner_code = joiner.wait(90)
    finally:
        for p in (joiner, run.launcher):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    joiner_log = (tmp_path / "joiner.log").read_text()
    assert code == 0, out[-4000:]
    assert joiner_code == 0, joiner_log[-4000:]
    assert "finished at step 40" in joiner_log, joiner_log[-4000:]
