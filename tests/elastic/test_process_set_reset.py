"""Process sets under elastic training: a worker SIGKILLed and restarted, the survivors register
their sets again in a reset callback and the restarted worker at its start, and the job goes on
using the set in every new view, with the commit invariants intact (docs/guide/process-sets.md)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.timeout(240)

WORKER = str(Path(__file__).with_name("process_set_worker.py"))


def test_sets_registered_again_in_a_reset_callback_keep_working_after_a_worker_dies(tmp_path: Path) -> None:
    run = harness.start(tmp_path, workers=3, min_np=2, steps=80, pause_s=0.03, worker=WORKER)
    run.wait_for_step(10, 90)
    harness.wait_for_world(run, 3, 60)
    run.signal("SIGKILL", signal.SIGKILL, run.workers()[1])
    code, out = run.finish(180)
    assert code == 0, out[-4000:]
    assert "restoring the last commit" in out, out[-4000:]
    harness.check_invariants(run.records(), 80)
    views = {int(v) for v in re.findall(r"set view=(\d+)", out)}
    assert len(views) >= 2, out[-4000:]  # the set ran in the first view and again after the reset
    assert "InvalidArgumentError" not in out and "not registered" not in out, out[-4000:]
