"""Elastic training with checksums on, over a link that damages one frame: every rank aborts the
step, restores its last commit and retries in the same view, and training ends with equal replicas.

Two worker processes run elastic_worker.py; the stream into rank 1 passes through a relay that
flips one byte of rank 0's first gradient frame (its bytes are known in advance: at step 0 the
gradient is the worker's seeded random draw).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from relay import Relay
from worlds import coordinator_config, free_port

from ringserve import Coordinator
from ringserve.loop import LoopThread

WORKER = str(Path(__file__).with_name("elastic_worker.py"))
DIM = 1 << 14  # elastic_worker.DIM
STEPS = 6

pytestmark = pytest.mark.timeout(120)



def test_a_damaged_frame_makes_every_rank_retry_the_step_in_the_same_view(tmp_path: Path) -> None:
    # Rank 0's first frame to rank 1 carries its step-0 gradient's second half (ring segment 1).
    grad0 = np.random.default_rng(0 * 7919 + 0).standard_normal(DIM)
    pattern = grad0[DIM // 2 + 100 : DIM // 2 + 104].tobytes()
    loop = LoopThread(use_uvloop=False)
    coord = loop.run(Coordinator(coordinator_config(min_workers=2, max_workers=2)).start(), 10)
    port = free_port()
    relay = Relay(port, flip_after=pattern)
    relay_port = loop.run(relay.start(), 10)
    log = tmp_path / "commits.jsonl"
    common = {"RINGSERVE_COORDINATOR": coord.address, "RINGSERVE_CHECKSUM": "1",
              "RINGSERVE_ABORT_GRACE_S": "1", "RINGSERVE_COLLECTIVE_TIMEOUT_S": "30",
                  "RINGSERVE_SHARED_MEMORY": "0",  # the relay sits on the TCP stream: payloads go through it
              "RINGSERVE_PAYLOAD_LANE": "off",  # (test_payload_lane.py damages the TCP payload lane's)
              "PYTHONPATH": str(Path(__file__).parent)}
    envs = [{**common, "RINGSERVE_RANK_HINT": "0"},
            {**common, "RINGSERVE_RANK_HINT": "1", "RINGSERVE_BIND_PORT": str(port),
             "RINGSERVE_ADVERTISE_PORT": str(relay_port)}]
    procs = [subprocess.Popen([sys.executable, WORKER, str(log), str(STEPS), "0.01"], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for env in envs]
    try:
        outputs = [p.communicate(timeout=90)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        loop.run(relay.close(), 10)
        loop.run(coord.stop(), 10)
        loop.stop()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert f"finished at step {STEPS}" in out
        assert "retrying in the same view (1 of 3)" in out, out[-3000:]
    assert relay.flipped == 1
    records = [json.loads(line) for line in log.read_text().splitlines()]
    by_step: dict[int, set[str]] = {}
    for r in records:
        by_step.setdefault(r["step"], set()).add(r["sha"])
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert all(len(shas) == 1 for shas in by_step.values()), by_step  # the replicas never differ
    assert len({r["view"] for r in records}) == 1  # no view change: the ring was never broken
