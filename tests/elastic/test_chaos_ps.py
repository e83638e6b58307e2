"""The chaos campaign's parameter-server job (benchmarks/chaos_jobs/ps.py): four workers in ``ssp``
mode through two shard processes under ``ringserve run --ps 2``, with shards and workers killed
(SIGKILL) by the campaign's own fault loop. The job must end with exit 0, every fault recovered,
no hang, and one final hash: every worker pulls the same values once all have pushed every step,
whatever the shards' restarts lost."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import chaos
from chaos_jobs import ps

# The launcher's shard supervisor's note of a shard the campaign killed (SIGKILL: -9) and that it
# starts again: a fault injected, not a death of the job's own.
SHARD_RESTARTED = re.compile(r"parameter-server shard \d+ exited with code -9: starting it again")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kinds", [("shard-kill",), ("kill", "shard-kill")], ids=["shards", "shards-and-workers"])
def test_an_ssp_job_survives_killed_shards_and_workers_and_its_workers_end_on_one_hash(
        tmp_path: Path, kinds: tuple[str, ...]) -> None:
    job = chaos.Job("ps-ssp", ps.WORKER, {}, kinds, steps=600, start=ps.start)
    lines: list[str] = []
    result = chaos.run_job(job, 0, 3, random.Random(40), tmp_path, lines.append)
    said = "\n".join(lines)
    print(said)
    output = (tmp_path / "000-ps-ssp" / "output.log").read_text()
    assert result.code == 0, output[-4000:]
    assert not result.hung, said
    assert len(result.faults) == 3, said
    assert all(o.recovery_s is not None for o in result.faults), said
    assert result.divergent == 0 and result.final_hashes == 1, said
    # A worker's clock never goes back: after a fault the slowest trails the furthest step before
    # it by ssp's staleness at most.
    assert all(o.steps_lost <= ps.STALENESS for o in result.faults), said
    shard_kills = sum(1 for o in result.faults if o.kind == "shard-kill")
    others = [line for line in result.untyped if not SHARD_RESTARTED.search(line)]
    assert others == [], output[-4000:]
    assert len(result.untyped) - len(others) == shard_kills, said
    records = [json.loads(line) for line in (tmp_path / "000-ps-ssp" / "commits.jsonl").read_text().splitlines()]
    finals = [r for r in records if r["view"] == 0]
    # Every worker that finished (a replacement started after the others finished leaves untrained).
    assert len(finals) >= ps.WORKERS - 1 and {r["step"] for r in finals} == {job.steps}, finals
