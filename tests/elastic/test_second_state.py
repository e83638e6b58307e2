"""A second training in the same job, with a new elastic state on every member, is no loss.

The job's mark (ringserve/commits.py) says how far the first training committed; the second
state holds less. A view whose members all hold less than the mark used to take that for a loss
whose holders were "back" (they are the members themselves), and made view after view without
end. Each member knows it holds less than it reported itself, which only a new state does: the
second training starts a lineage above the mark and runs.
"""

from __future__ import annotations

from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = str(Path(__file__).with_name("second_state_worker.py"))


def test_a_second_elastic_run_with_a_new_state_in_the_same_job_trains_from_its_own_start(tmp_path: Path) -> None:
    run = harness.start(tmp_path, workers=2, steps=15, pause_s=0.01, restart=False, worker=WORKER)
    code, out = run.finish(90)
    assert code == 0, out[-4000:]
    assert out.count("trainings ended at steps 15 and 15 (w 15), the second in lineage 1") == 2, out[-4000:]
    assert "holder is back" not in out, out[-4000:]
