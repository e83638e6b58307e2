"""No silent regression: when every worker holding the job's last commit is killed while a restarted
worker is in the view without the state, the next world resumes from the checkpoint directory, or,
without one, fails with StateLostError on every rank and `ringserve run` ends with exit code 65. It
never starts again from a fresh process's step 0 and exits 0, as it did before."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import harness
import numpy as np
import pytest

from ringserve.commits import Commit
from ringserve.elastic.checkpoint import decode, file_name
from ringserve.errors import STATE_LOST_EXIT_CODE

pytestmark = pytest.mark.timeout(180)


def kill_every_holder_while_a_fresh_worker_syncs(tmp_path: Path, steps: int, worker: str = harness.WORKER,
                                                 env: dict[str, str] | None = None,
                                                 written: Callable[[int], bool] | None = None,
                                                 ) -> tuple[harness.Run, int, float]:
    """Three workers train; one is killed and restarted; while the restarted one is in the view but
    has not taken the state, the two that hold it are killed in the same millisecond.

    ``written(step)``: whether the durable copy of that commit is written; the kill waits for it
    (rank 0 writes on a thread of its own, which a loaded machine can leave a commit behind: the
    world then rightly resumes from the one before, as the log says, which is not what the test is about).

    Returns the run, the furthest step committed before, and when the holders were killed.
    """
    hold = tmp_path / "hold"
    run = harness.start(tmp_path, workers=3, min_np=2, steps=steps, pause_s=0.03, worker=worker,
                        env={"HOLD_FRESH_SYNC": str(hold), **(env or {})})
    run.wait_for_step(10, 120)
    harness.wait_for_world(run, 3, 60)  # else a slow starter could join late, and be the fresh one
    first = set(run.workers())
    run.signal("kill -9", signal.SIGKILL)
    fresh = harness.wait_for_fresh_syncs(hold, 1, 60, ignore=first)
    holders = [pid for pid in run.workers() if pid not in fresh]
    assert len(holders) == 2, f"expected the two holders besides the fresh worker {fresh}: {run.workers()}"
    before = max(r["step"] for r in run.records())
    deadline = time.monotonic() + 30
    while written is not None and not written(before):
        assert time.monotonic() < deadline, f"the checkpoint of commit {before} was not written within 30 s"
        time.sleep(0.05)
    killed_at = harness.kill_together(run, holders)
    Path(f"{hold}.go").touch()
    return run, before, killed_at


def test_without_a_durable_copy_the_world_that_lost_every_holder_fails_on_every_rank_and_the_launcher_exits_65(
    tmp_path: Path,
) -> None:
    run, before, killed_at = kill_every_holder_while_a_fresh_worker_syncs(tmp_path, steps=100_000)
    code, out = run.finish(90)
    assert code == STATE_LOST_EXIT_CODE, out[-4000:]
    assert "restarting nobody and ending the run" in out, out[-4000:]
    failed = {int(m.group(1)) for m in re.finditer(r"^\[(\d+)\] ringserve\.errors\.StateLostError: ", out, re.M)}
    assert len(failed) >= 2, f"StateLostError on ranks {failed} only:\n{out[-4000:]}"
    # The error names the last commit and both workers that held it, by rank and view.
    assert re.search(rf"every worker holding commit {before} died \(rank \d of view \d+, worker \w+ at [\d.:]+; "
                     rf"rank \d of view \d+, worker \w+ at [\d.:]+\)", out), out[-4000:]
    assert "no durable copy: RINGSERVE_CHECKPOINT_DIR" in out
    records = run.records()
    assert not [r for r in records if r["time"] > killed_at], "a world committed after losing the state"
    assert harness.check_no_silent_regression(records, out) == []


def checkpointed_weights(ckpt: Path, lineage: int, step: int) -> np.ndarray:
    commit, state = decode((ckpt / file_name(Commit(lineage, step))).read_bytes())
    assert commit == Commit(lineage, step)
    saved = pickle.loads(state)
    assert saved["step"] == step
    return saved["w"]


def sha(w: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()


def test_with_a_checkpoint_directory_the_world_resumes_from_the_last_commit_and_says_so(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run, before, killed_at = kill_every_holder_while_a_fresh_worker_syncs(
        tmp_path, steps=250, env={"RINGSERVE_CHECKPOINT_DIR": str(ckpt), "RINGSERVE_CHECKPOINT_KEEP": "100000"},
        written=lambda step: (ckpt / file_name(Commit(0, step))).exists())
    code, out = run.finish(120)
    assert code == 0, out[-4000:]
    resumed = harness.resumed_steps(out)
    # The holders were killed once rank 0 had written their last commit.
    assert resumed == {before}, out[-4000:]
    assert re.search(rf"every worker holding commit {before} died \(rank \d of view \d+, .*; rank \d of view", out)
    assert f"resuming from the checkpoint of commit {before} in {ckpt}" in out
    records = run.records()
    harness.check_invariants(records, 250)
    assert min(r["step"] for r in records if r["time"] > killed_at) == before + 1
    assert harness.check_no_silent_regression(records, out) == []
    # The durable copy is the state the holders committed, and the resumed world went on from it:
    # its first step (lineage 1) is one training step away from the checkpoint's weights.
    w = checkpointed_weights(ckpt, 0, before)
    assert {r["sha"] for r in records if r["step"] == before and r["time"] < killed_at} == {sha(w)}
    after = checkpointed_weights(ckpt, 1, before + 1)
    first = [r for r in records if r["step"] == before + 1 and r["time"] > killed_at]
    assert {r["sha"] for r in first} == {sha(after)}
    size = len({r["pid"] for r in first})
    grads = [np.random.default_rng(before * 7919 + rank).standard_normal(len(w)) + 0.01 * w for rank in range(size)]
    np.testing.assert_allclose(after, w - 0.05 * np.mean(grads, axis=0), rtol=0, atol=1e-12)


def test_with_the_coordinators_parameter_store_as_the_durable_copy_the_world_resumes_from_it(tmp_path: Path) -> None:
    run, before, killed_at = kill_every_holder_while_a_fresh_worker_syncs(
        tmp_path, steps=250, env={"RINGSERVE_CHECKPOINT_DIR": "coordinator://"})
    code, out = run.finish(120)
    assert code == 0, out[-4000:]
    assert harness.resumed_steps(out) == {before}, out[-4000:]
    assert f"resuming from the checkpoint of commit {before} in coordinator://" in out
    records = run.records()
    harness.check_invariants(records, 250)
    assert min(r["step"] for r in records if r["time"] > killed_at) == before + 1


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = harness.start(tmp_path, workers=2, steps=30, pause_s=0.01, restart=False,
                        env={"RINGSERVE_CHECKPOINT_DIR": str(ckpt), "RINGSERVE_CHECKPOINT_EVERY": "4"})
    code, out = run.finish(60)
    assert code == 0, out[-3000:]
    # Every 4th commit, the last one written before run() returned; two kept (the default).
    assert sorted(os.listdir(ckpt)) == [file_name(Commit(0, 24)), file_name(Commit(0, 28))]


@pytest.mark.slow  # torch's import in every restarted process: about 30 s on two loaded cores
def test_a_torch_state_resumes_from_its_checkpoint_with_model_and_optimizer(tmp_path: Path) -> None:
    # Enough steps that the two survivors are still training when the restarted worker, slow to
    # import torch, is admitted.
    ckpt = tmp_path / "ckpt"
    run, before, killed_at = kill_every_holder_while_a_fresh_worker_syncs(
        tmp_path, steps=400, worker=harness.TORCH_WORKER, env={"RINGSERVE_CHECKPOINT_DIR": str(ckpt)})
    code, out = run.finish(150)
    assert code == 0, out[-4000:]
    assert harness.resumed_steps(out) == {before}, out[-4000:]
    records = run.records()
    harness.check_invariants(records, 400)
    assert min(r["step"] for r in records if r["time"] > killed_at) == before + 1
