"""A worker that comes to a running world is admitted once it is ready to train, not at init.

A joiner that takes seconds after ``init()`` (imports, a large model, its data) used to cost the
members those seconds: it was admitted at init, and their next commit waited for it in the new
view. Now (``admit_when_ready``, the default of ``ringserve.init()``) init returns at once with
the rank and size it would get, the members train on while it prepares, and it is admitted at
their commit after it reaches ``elastic.run``. Turned off, the old stall is back: the test shows
both, so that it cannot pass without the feature.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.timeout(180)

PREPARE_S = 4.0  # what the joiner takes between init and elastic.run


def stall_around(records: list[dict], survivors: set[int], start: float, end: float) -> float:
    """The survivors' longest gap between two commits that ends after ``start`` and starts before ``end``."""
    gaps = []
    for pid in survivors:
        times = sorted(r["time"] for r in records if r["pid"] == pid)
        gaps += [b - a for a, b in itertools.pairwise(times) if b > start and a < end]
    return max(gaps)


@pytest.mark.parametrize("when", ["ready", "at-init"])
def test_a_joiner_that_prepares_for_seconds_after_init_costs_the_members_no_stall(tmp_path: Path, when: str) -> None:
    steps = 10_000  # stopped by the test
    run = harness.start(tmp_path, workers=2, steps=steps, pause_s=0.02, min_np=2, max_np=3, restart=False)
    joiner = None
    try:
        address = harness.coordinator_address(run)
        run.wait_for_step(20, 60)
        survivors = {r["pid"] for r in run.records()}
        env = {"ELASTIC_PREPARE_S": str(PREPARE_S), "RINGSERVE_ADMIT_WHEN_READY": "1" if when == "ready" else "0"}
        joiner = harness.start_worker(address, run.log, steps, 0.02, env=env, output=tmp_path / "joiner.log")
        started = time.time()
        deadline = started + 60
        while not any(r["pid"] == joiner.pid for r in run.records()):
            assert time.time() < deadline, (tmp_path / "joiner.log").read_text()[-3000:]
            time.sleep(0.05)
        joined_at = min(r["time"] for r in run.records() if r["pid"] == joiner.pid)
        records = run.records()
    finally:
        if joiner is not None:
            joiner.kill()
            joiner.wait()
        run.launcher.kill()
        run.launcher.wait()
    out = (tmp_path / "joiner.log").read_text()
    stall = stall_around(records, survivors, started, joined_at + 0.5)
    print(f"\n{when}: the members' longest gap between commits around the join {stall:.2f} s "
          f"(the joiner prepares {PREPARE_S:g} s; it first committed {joined_at - started:.2f} s after its start)")
    if when == "ready":
        assert "init: rank 2 of 3" in out, out[-3000:]  # where it would stand, before it is admitted
        assert stall < 1.5, f"the members stalled {stall:.2f} s for a joiner that was not ready"
    else:
        assert stall > PREPARE_S - 1, f"admitted at init, the joiner still cost the members only {stall:.2f} s"
