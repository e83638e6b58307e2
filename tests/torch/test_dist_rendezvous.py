"""init_process_group("ringserve") finds its world the ways a job starts, and checks it.

Under ringserve's coordinator (RINGSERVE_COORDINATOR, as ``ringserve run`` sets it), with rank 0
starting one (torch's variables only, as torchrun sets them), with ``init_method=ringserve://``,
beside ``ringserve.torch.init()``; a world size the view does not have is a clear error; and
RINGSERVE_COMPRESSION picks all_reduce's codec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _dist_worlds import DIST_WORKERS, run_dist

SCRIPT = DIST_WORKERS / "dist_rendezvous.py"


def _seen(out: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch", ["env", "rank0"])
def test_env_rendezvous_joins_the_coordinator_or_starts_one_on_rank_0(tmp_path: Path, launch: str) -> None:
    run_dist(SCRIPT, 2, tmp_path, ["env"], launch=launch, timeout_s=100)
    for r, seen in enumerate(_seen(tmp_path, 2)):
        assert (seen["rank"], seen["size"], seen["backend"], seen["sums"]) == (r, 2, "ringserve", True), seen
        # The backend started this worker, so destroying the group shut it down.
        assert seen["ringserve_running_after"] is False


@pytest.mark.timeout(120)
def test_a_ringserve_init_method_takes_rank_and_size_from_the_view_and_serves_torch_a_store(tmp_path: Path) -> None:
    run_dist(SCRIPT, 3, tmp_path, ["init_method"], timeout_s=100)
    seen = _seen(tmp_path, 3)
    assert sorted(s["rank"] for s in seen) == [0, 1, 2]
    for s in seen:
        assert s["size"] == 3 and s["sums"] is True, s
        assert s["store"] == ["0", "1", "2"], s


@pytest.mark.timeout(120)
def test_a_world_size_the_view_does_not_have_is_a_clear_error_and_leaves_nothing_running(tmp_path: Path) -> None:
    run_dist(SCRIPT, 2, tmp_path, ["wrong_size"], timeout_s=100)
    for seen in _seen(tmp_path, 2):
        assert seen["error"].startswith("InvalidArgumentError: torch.distributed was given world_size=3, but"), seen
        assert "has 2 ranks" in seen["error"], seen
        assert seen["initialized"] is False and seen["ringserve_running"] is False


@pytest.mark.timeout(120)
def test_a_group_made_after_hvd_init_shares_its_worker_and_leaves_it_running(tmp_path: Path) -> None:
    run_dist(SCRIPT, 2, tmp_path, ["hvd_first"], timeout_s=100)
    for seen in _seen(tmp_path, 2):
        assert seen["sums"] is True and seen["ringserve_running_after"] is True and seen["hvd_after"] == 2.0, seen


@pytest.mark.timeout(120)
def test_ringserve_compression_chosen_by_the_environment_rounds_all_reduce_alike_on_every_rank(tmp_path: Path) -> None:
    run_dist(SCRIPT, 2, tmp_path, ["compression"], timeout_s=100, env={"RINGSERVE_COMPRESSION": "int8"})
    for seen in _seen(tmp_path, 2):
        assert seen["sums"] is True  # small integers survive int8's rounding exactly
        assert seen["rounded"] is True and seen["close"] is True and seen["identical"] is True, seen
