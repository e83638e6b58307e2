"""Every torch.distributed op on the "ringserve" backend gives what gloo's would, in real worlds.

The ranks check their own results (workers/dist_ops.py: each rank knows every rank's inputs);
this test checks that every rank got through every check, at worlds 2 and 3 (an odd world, where
the ring's segments are uneven).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _dist_worlds import DIST_WORKERS, run_dist

# What every rank must have checked, at least: one name per op family.
MUST = ["all_reduce sum torch.bfloat16", "all_reduce of a strided view", "reduce", "reduce_scatter_tensor",
        "reduce_scatter (list)", "broadcast torch.bool", "all_gather (uneven) from rank 1", "all_gather_into_tensor",
        "scatter", "barrier", "all_gather_object", "scatter_object_list", "12 async all_reduces in flight at once",
        "BAND of floats names the op and the dtype", "AVG of integers says why", "isend/irecv round the ring", "the world works after the refusals",
        "new_group of every rank", "a gloo group beside the ringserve one"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3])
def test_every_op_gives_the_expected_result_on_every_rank(tmp_path: Path, n: int) -> None:
    run_dist(DIST_WORKERS / "dist_ops.py", n, tmp_path, timeout_s=150)
    passed = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    for r, names in enumerate(passed):
        missing = [m for m in MUST if m not in names]
        assert not missing, f"rank {r} did not check {missing}"
    assert "gather" in passed[0] and "new_group of some ranks" in passed[0]
    assert all("a non-member of new_group gets no group" in p for p in passed[1:])
    assert len({len(p) for p in passed[1:]}) == 1
