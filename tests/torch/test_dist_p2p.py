"""all_to_all, send/recv and new_group on the "ringserve" backend give what gloo's give, in real worlds.

Each rank runs every op on ringserve and on a gloo group of the same ranks, with the same inputs,
and checks that the results are equal and right (workers/dist_p2p.py). This test checks that every
rank got through every check, at worlds 2 and 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _dist_worlds import DIST_WORKERS, run_dist

# What every rank must have checked, at least: one name per op family.
MUST = ["all_to_all_single even torch.bfloat16 equals gloo's", "all_to_all_single uneven equals gloo's",
        "all_to_all (lists) equals gloo's", "all_to_all_single with splits wrong on rank 0 fails every rank at once",
        "isend/irecv ring shift equals gloo's",
        "batch_isend_irecv both ways equals gloo's", "barrier after the messages",
        "subgroups' and the world's all_reduces in flight at once", "new_subgroups' all_reduce equals gloo's",
        "new_subgroups_by_enumeration's all_reduce"]
# What the two ends of the tagged exchange (ranks 0 and the last) checked.
ENDS = ["tagged message 2 of tag 0 both ways at once", "tagged message 0 of tag 1 both ways at once",
        "send then recv on both ends, into a strided view"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all_send_recv_and_subgroups_equal_gloo_on_every_rank(tmp_path: Path, n: int) -> None:
    run_dist(DIST_WORKERS / "dist_p2p.py", n, tmp_path, timeout_s=200)
    passed = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    for r, names in enumerate(passed):
        firsts = ["recv from any source equals gloo's", "recv from any source: each sender's messages"] if r == 0 else []
        missing = [m for m in MUST + firsts + (ENDS if r in (0, n - 1) else []) if m not in names]
        assert not missing, f"rank {r} did not check {missing}"
    if n == 4:
        # Every rank is in two of the four subgroups and checked its ops there, beside gloo's.
        for r, names in enumerate(passed):
            groups = [m for m in ([0, 2], [1, 3], [0, 1, 3], [2]) if r in m]
            for m in groups:
                for op in ("all_reduce on {} equals gloo's new_group", "broadcast on {} equals gloo's", "scatter on {}"):
                    assert op.format(m) in names, (r, op.format(m))
            assert "all_to_all_single uneven on group [0, 1, 3] equals gloo's" in names or r == 2
            assert "a non-member of [0, 2] gets no group" in names or r in (0, 2)
