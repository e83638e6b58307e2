"""A DDP job over ringserve recovers from a peer's death the two ways docs/guide/torch-distributed.md describes.

workers/dist_restart.py checkpoints every 5 steps; rank 1 kills itself at step 12 in its first
life. Under ``torchrun --max-restarts 1`` the agent restarts every rank; under ``ringserve run
--restart-failed`` only rank 1 restarts, and the survivor makes a new group with it. Either way
every rank resumes from step 10 and ends with the parameters of a run that never failed (one
process on the mean gradient of both ranks' batches).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _dist_worlds import DIST_WORKERS, run_dist

sys.path.insert(0, str(DIST_WORKERS))
import dist_restart


def _never_failed(world: int) -> dict[str, torch.Tensor]:
    model = dist_restart.net()
    optimizer = dist_restart.optimizer_of(model)
    for step in range(dist_restart.STEPS):
        optimizer.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(x), y)
                   for x, y in (dist_restart.batch(step, r) for r in range(world))) / world
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["torchrun", "ringserve"])
def test_a_job_whose_peer_dies_resumes_from_its_checkpoint_and_ends_as_if_it_never_failed(tmp_path: Path, mode: str) -> None:
    launch = "torchrun" if mode == "torchrun" else "ringserve-run"
    extra = {"torchrun": ["--max-restarts", "1"], "ringserve": ["--restart-failed", "--max-restarts", "1"]}[mode]
    run_dist(DIST_WORKERS / "dist_restart.py", 2, tmp_path, [mode], launch=launch, timeout_s=360,
             launcher_args=extra)
    assert (tmp_path / "died").exists()
    records = [torch.load(p) for p in sorted(tmp_path.glob("rank*.pt"))]
    assert sorted(r["rank"] for r in records) == [0, 1], records
    expected = _never_failed(2)
    for record in records:
        assert record["resumed_from"] == [10], record
        for key, value in expected.items():
            torch.testing.assert_close(record["final"][key], value, rtol=1e-5, atol=1e-6)
    if mode == "ringserve":
        survivor = next(r for r in records if r["rank"] == 0)
        assert survivor["groups"] == 2 and len(survivor["errors"]) == 1, survivor
