"""The chaos campaign's short run (benchmarks/chaos.py --quick): ten faults (kills, pair kills,
hung workers, lane resets) against two live jobs, one on shared memory and one on the payload
lane, with 0 hangs, 0 untyped errors, 0 divergent replicas, 0 lost commits and every fault
recovered. The full campaign (300 faults over every job) is one command, documented in
docs/ops/chaos.md; this is the part of it that the default suite runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import chaos

pytestmark = pytest.mark.timeout(240)


def test_ten_faults_of_the_campaign_leave_no_hang_untyped_error_divergence_or_lost_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = chaos.main(["--faults", "10", "--seed", "40", "--quick", "--per-job", "5", "--workdir", str(tmp_path / "work"),
                       "--json", str(tmp_path / "campaign.json")])
    out = capsys.readouterr().out
    print(out)
    totals = dict(part.split("=") for part in out.strip().splitlines()[-1].split(" ") if "=" in part)
    assert code == 0, out
    assert int(totals["faults"]) == 10, out
    for bad in ("hangs", "untyped", "divergent", "lost_commits", "unrecovered", "unfinished_jobs"):
        assert totals[bad] == "0", out
