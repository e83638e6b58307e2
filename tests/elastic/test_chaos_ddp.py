"""The chaos campaign's torchrun job (benchmarks/chaos_jobs/ddp.py): DDP over the ringserve backend
under torchrun's elastic agent, its workers killed and stopped by the campaign's own fault loop
(``chaos.main``). Each fault ends in the agent restarting the whole group from rank 0's checkpoint;
the job must end with exit 0, every fault recovered, no hang, no traceback, and one final hash."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import chaos

NAME = "ddp-torchrun"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_torchrun_ddp_job_restarted_after_each_fault_resumes_and_ends_on_one_hash(
        tmp_path: Path) -> None:
    # Its faults' bounds are the group restart's (chaos.GROUP_RESTART_BOUND_S: four fresh torch
    # processes), not the kill's.
    report = tmp_path / "chaos.json"
    code = chaos.main(["--faults", "3", "--per-job", "3", "--seed", "1", "--jobs", NAME,
                       "--workdir", str(tmp_path / "work"), "--json", str(report)])
    result = json.loads(report.read_text())
    output = next((tmp_path / "work").glob(f"*-{NAME}/output.log")).read_text()
    assert code == 0, (result["totals"], output[-4000:])
    assert result["totals"]["faults"] == 3 and result["totals"]["unrecovered"] == 0, result["totals"]
    (only,) = result["jobs"]
    assert only["code"] == 0 and only["final_hashes"] == 1 and only["divergent"] == 0, only
    # A peer's death must end a rank in one line, not a traceback.
    assert "Traceback" not in output, output[-4000:]
    # The faults restarted the group (a stop does too, past the heartbeat timeout), and all four
    # ranks of each new group resumed from the checkpoint.
    resumed = output.count("resuming from the checkpoint")
    assert resumed >= 4 and resumed % 4 == 0, output[-4000:]
