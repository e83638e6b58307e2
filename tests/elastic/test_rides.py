"""A commit's check rides on the next step's gradient allreduce, and still admits a joiner.

Each commit asks every rank whether workers wait to join (and whether one wants to leave). With a
``DistributedOptimizer`` in the ``TorchState``, that question goes in the next step's gradient
buckets (ringserve.elastic.rider) instead of an allreduce of its own. This test runs the torch
loop of the chaos tests (one bucket a step), lets a third worker join it, and checks that the
members admitted it at a commit, that every replica committed the same parameters, and that the
members ran about one allreduce a step, not two.
"""

from __future__ import annotations

import re
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.timeout(180)

STEPS = 600


def test_a_joiner_is_admitted_through_the_flags_that_the_gradient_allreduce_carries(tmp_path: Path) -> None:
    run = harness.start(tmp_path, workers=2, steps=STEPS, pause_s=0.02, min_np=2, max_np=3, restart=False,
                        worker=harness.TORCH_WORKER)
    joiner = None
    try:
        address = harness.coordinator_address(run)
        run.wait_for_step(20, 60)
        members = {r["pid"] for r in run.records()}
        joiner = harness.start_worker(address, run.log, STEPS, 0.02, worker=harness.TORCH_WORKER,
                                      output=tmp_path / "joiner.log")
        code, out = run.finish(120)
        assert joiner.wait(30) == 0, (tmp_path / "joiner.log").read_text()[-3000:]
    finally:
        if joiner is not None and joiner.poll() is None:
            joiner.kill()
            joiner.wait()
        if run.launcher.poll() is None:
            run.launcher.kill()
            run.launcher.wait()
    assert code == 0, out[-4000:]
    records = run.records()
    harness.check_invariants(records, STEPS)
    joined = [r for r in records if r["pid"] == joiner.pid]
    assert joined, "the joiner never committed"
    first = min(r["step"] for r in joined)
    assert first < STEPS - 10, f"the joiner was admitted only at step {first}"
    assert {r["pid"] for r in records if r["step"] == STEPS} == members | {joiner.pid}
    counts = [int(n) for n in re.findall(r"finished at step \d+ after (\d+) allreduces", out)]
    assert len(counts) == 2, out[-4000:]
    # One bucket a step, plus the few allreduces of the syncs (at the start and at the join): a
    # check of its own at each commit would make it two a step.
    for count in counts:
        assert count < 1.2 * STEPS, f"{count} allreduces in {STEPS} steps: the commits' checks did not ride"
