"""Elastic Keras training with a worker killed mid-fit (``slow``; scripts/test_tf.sh runs it).

Three workers run ``model.fit`` under ``hvd.elastic.run`` with KerasState and the commit callbacks.
Rank 2 is killed with SIGKILL in the middle of epoch 1. The two others go back to their last commit
and go on without it; the launcher starts a replacement, which joins at a commit and takes the
state, on each Keras backend. Every process that finishes ends with the same weights and all the epochs done.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from keras_worlds import ENV, REPO, WORKERS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EPOCHS = 6


@pytest.mark.parametrize("backend", ["torch", pytest.param("tensorflow", marks=pytest.mark.tensorflow)])
def test_a_worker_killed_mid_fit_costs_a_rollback_and_the_replacement_takes_the_state(tmp_path: Path, backend: str) -> None:
    env = {**os.environ, **ENV, "KERAS_BACKEND": backend,
           "RINGSERVE_ELASTIC_TIMEOUT_S": "90",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "ringserve.cli", "run", "-np", "3", "--min-np", "2", "--max-np", "3",
           "--heartbeat-timeout", "5", "--restart-failed", "--max-restarts", "2",
           sys.executable, str(WORKERS / "keras_elastic.py"), str(tmp_path), str(EPOCHS)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=260)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the elastic Keras run hung:\n{output[-6000:]}") from None
    assert proc.returncode == 0, f"the elastic Keras run failed ({proc.returncode}):\n{output[-6000:]}"
    assert (tmp_path / "killed").exists(), "rank 2 was never killed: the test tested nothing"

    done = [pickle.loads(p.read_bytes()) for p in sorted(tmp_path.glob("done-*.pkl"))]
    assert len(done) == 3, f"{len(done)} workers finished, not 3:\n{output[-4000:]}"
    for d in done:
        assert d["epoch"] == EPOCHS
        assert 3 in d["sizes"], d["sizes"]
    for d in done[1:]:
        for a, b in zip(done[0]["weights"], d["weights"], strict=True):
            np.testing.assert_array_equal(a, b)
    # The world went down to 2 and back to 3 (the replacement joined) while the survivors trained.
    assert any(2 in d["sizes"] and 3 in d["sizes"][d["sizes"].index(2):] for d in done), [d["sizes"] for d in done]
    # The survivors rolled back (a reset ran with the world of 2), and the replacement started past epoch 0.
    assert any(2 in d["resets"] for d in done), [d["resets"] for d in done]
    assert any(d["first_epoch"] >= 1 for d in done), [d["first_epoch"] for d in done]
