"""Commits in place (WorkerConfig.commit_in_place), on a real world of three processes
(workers/in_place.py): a commit keeps the live tensors that only the optimizer's step changes, and
copies the rest; a second step with no commit between refuses to run; a restore with nothing
changed keeps the commit; a rank whose tensors moved past the commit drops it and takes the
others' state at the sync; a world where every rank moved past it fails by name.
"""

from __future__ import annotations

import json

import pytest
from _worlds import WORKERS, RunWorld

N = 3

pytestmark = pytest.mark.timeout(180)


def test_a_commit_in_place_keeps_the_live_tensors_and_a_rank_that_moved_past_it_takes_the_others_state(
        world_runner: RunWorld) -> None:
    run = world_runner(WORKERS / "in_place.py", N, timeout_s=120,
                       env={"RINGSERVE_COMMIT_IN_PLACE": "1", "RINGSERVE_HOLDER_WAIT_S": "0"})
    ranks = [json.loads((run.out_dir / f"rank{r}.json").read_text()) for r in range(N)]
    for r, rank in enumerate(ranks):
        # The trained parameters and the optimizer's moments are kept live; the batch norm's
        # running statistics (which the forward pass changes) are copied.
        assert rank["kept"] == {"weight": True, "bias": True, "running_mean": False, "exp_avg": True}, rank["kept"]
        assert rank["second_step"] and "a second time since state.commit()" in rank["second_step"], rank
        assert rank["intact"] == {"commits": rank["intact"]["before"], "before": rank["intact"]["before"],
                                  "dropped": False}, rank["intact"]
        moved = rank["one_moved"]
        assert moved["dropped"] == (r == N - 1), f"rank {r}: {moved}"
        assert moved["commits"] == moved["before"] + 1 and not moved["dropped_after"], f"rank {r}: {moved}"
        assert rank["guard_after_drop"] is None, f"rank {r}: a dropped rank still guards a commit"
        assert rank["all_moved"] and rank["all_moved"].startswith("StateLostError"), f"rank {r}: {rank['all_moved']}"
    # The moved rank took the others' parameters: its change is gone.
    assert len({rank["sha"] for rank in ranks}) == 1, "the replicas' parameters differ after the sync"
