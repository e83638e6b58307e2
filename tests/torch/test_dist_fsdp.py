"""FSDP2 (fully_shard) trains on CPU over ringserve, and DCP saves and loads it.

FSDP2's all_gather_into_tensor and reduce_scatter_tensor, DeviceMesh's group, and the checkpoint
planner's object collectives all run on the "ringserve" backend (workers/dist_fsdp.py). The two
ranks train to the parameters one process reaches on both ranks' batches (FSDP2 averages the
gradients), and a fresh sharded model loads back exactly what was saved; and so do four ranks
under HSDP (a 2 x 2 DeviceMesh: its replicate and shard groups are sub-rings, new_group).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _dist_worlds import DIST_WORKERS, run_dist

sys.path.insert(0, str(DIST_WORKERS))
import dist_fsdp


def _one_process(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = dist_fsdp.net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generators = [torch.Generator().manual_seed(r) for r in range(world)]
    for _ in range(dist_fsdp.STEPS):
        optimizer.zero_grad()
        loss = sum(model(torch.randn(8, 16, generator=g)).pow(2).sum() for g in generators) / world
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "mesh"), [(2, []), (4, ["hsdp"])], ids=["fsdp-2", "hsdp-2x2"])
def test_fully_shard_trains_to_one_process_parameters_and_a_dcp_checkpoint_loads_back_exactly(
    tmp_path: Path, world: int, mesh: list[str]
) -> None:
    run_dist(DIST_WORKERS / "dist_fsdp.py", world, tmp_path, ["ringserve", *mesh], timeout_s=150)
    expected = _one_process(world)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, value in expected.items():
            torch.testing.assert_close(got["full"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            assert torch.equal(got["loaded"][key], got["full"][key]), f"rank {rank}: {key} did not load back"
    assert (tmp_path / "checkpoint_ringserve" / ".metadata").exists()
