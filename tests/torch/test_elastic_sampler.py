"""hvd.elastic.ElasticSampler under a real world change: ``ringserve run -np 3 --min-np 2``, one
rank leaves half way through the epoch, and the two left deal the rest of it between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _worlds import REPO, WORKERS

sys.path.insert(0, str(WORKERS))
import elastic_sampler as worker


@pytest.mark.timeout(120)
def test_an_epoch_resumes_in_the_smaller_world_with_every_index_processed_once(tmp_path: Path) -> None:
    env = {**os.environ, "RINGSERVE_COLLECTIVE_TIMEOUT_S": "30", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "ringserve.cli", "run", "-np", "3", "--min-np", "2", "--max-np", "3",
         sys.executable, str(WORKERS / "elastic_sampler.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    records = [json.loads(line) for log in tmp_path.glob("log.*.jsonl") for line in log.read_text().splitlines()]
    processed = [i for r in records for i in r["batch"]]
    assert sorted(processed) == list(range(worker.LENGTH)), "an index was lost or processed twice"
    before = [r for r in records if r["size"] == 3]
    after = [r for r in records if r["size"] == 2]
    assert len(before) == 3 * 4 and {r["rank"] for r in after} == {0, 1}
    # Resets record the world's size after each: one to 3 where the first view held only the two
    # workers that came first (they wait for the third before the epoch starts), then one to 2.
    assert all(set(r["resets"]) <= {3} for r in before), before
    assert all(r["resets"][-1] == 2 and r["resets"].count(2) == 1 and set(r["resets"]) <= {2, 3} for r in after), after
