"""Every torch.distributed call the "ringserve" backend supports gives what gloo gives, in one run.

Each rank of a world holds a ringserve and a gloo group over the same ranks (and one of each for
every subgroup), makes every call on both with the same inputs, and compares the results: exactly
for integer and bool dtypes, within a few units in the last place for floating point ones
(workers/diffing.py states the tolerance). Across dtypes, reduce ops, uneven, empty, scalar,
complex, sparse and non-contiguous tensors, subgroups, and the async_op=True forms. Where gloo
refuses a call, ringserve refuses it too, except where it does better (uneven all_gather and
all_to_all, recvs posted in another tag order than the sends), which are checked against what
they must give. The worlds of 2 and 3 run once for the module, at the same time. Where torch sees a
GPU, they run again with ringserve's tensors on it (gloo's stay on the CPU).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from _dist_worlds import DIST_WORKERS, start_dist
from _worlds import DEVICES, device_env

WORLDS = (2, 3)
# Checks every rank must have passed, one or more per family (the names of workers/dist_differential.py).
MUST = [
    "all_reduce RedOpType.SUM torch.float32 () async equals gloo's",
    "all_reduce RedOpType.BXOR torch.int32 (3, 5) equals gloo's",
    "all_reduce RedOpType.SUM torch.bool (2, 7) equals gloo's",
    "all_reduce RedOpType.BXOR torch.bool (2, 7) equals gloo's",
    "all_reduce RedOpType.PRODUCT torch.uint8 (2, 7) equals gloo's",
    "all_reduce RedOpType.BAND torch.float32 () is refused by both",
    "all_reduce RedOpType.SUM torch.bool strided async (ringserve only) gives what it should",
    "all_reduce RedOpType.BXOR torch.int16 () async (ringserve only) gives what it should",
    "all_reduce_coalesced RedOpType.SUM torch.bool async equals gloo's",
    "all_reduce sparse torch.float32 equals gloo's",
    "all_reduce sparse MAX is refused by both",
    "reduce RedOpType.SUM torch.float32 to 0 equals gloo's",
    "reduce_scatter RedOpType.SUM torch.bool equals gloo's",
    "reduce_scatter_tensor RedOpType.AVG torch.float64 equals gloo's",
    "all_gather torch.complex64 strided equals gloo's",
    "all_gather torch.int16 strided (ringserve only) gives what it should",
    "all_gather uneven (ringserve only) gives what it should",
    "all_gather_into_tensor torch.bool async equals gloo's",
    "all_gather_into_tensor torch.float32 stacked async (ringserve only) gives what it should",
    "all_gather_coalesced of 1 torch.float32 equals gloo's",
    "all_gather_coalesced of 3 torch.int64 equals gloo's",
    "all_gather_coalesced into transposed views equals gloo's",
    "all_gather_coalesced of {n} of one shape equals gloo's",
    "gather to 1 equals gloo's",
    "scatter from 1 async equals gloo's",
    "all_to_all_single with split sizes async equals gloo's",
    "all_to_all lists of uneven sizes (ringserve only) gives what it should",
    "broadcast torch.bool (5,) from 1 equals gloo's",
    "broadcast torch.bool strided from 1 (ringserve only) gives what it should",
    "barrier async equals gloo's",
    "object collectives equals gloo's",
    "send_object_list and recv_object_list equals gloo's",
    "isend/irecv ring shift equals gloo's",
    "batch_isend_irecv both ways equals gloo's",
    "recv and irecv from any source equals gloo's",
    "send/recv round the group equals gloo's",
]
if hasattr(dist, "all_gather_single"):  # torch 2.13's names for all_gather_into_tensor and reduce_scatter_tensor
    MUST.append("all_gather_single and reduce_scatter_single equals gloo's")
ENDS = ["messages received in another tag order than sent (ringserve only: gloo deadlocks)"]  # ranks 0 and 1 only
GROUPS = {2: ([1], [0, 1]), 3: ([0, 2], [1, 2])}


@pytest.fixture(scope="module", params=DEVICES)
def ranks(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
          ) -> Iterator[dict[int, list[dict[str, Any]]]]:
    """What every rank of the worlds of 2 and 3 recorded, both worlds run at once."""
    base = tmp_path_factory.mktemp("differential")
    env = device_env(request.param)
    with start_dist(DIST_WORKERS / "dist_differential.py", 2, base / "w2", env=env) as two, \
            start_dist(DIST_WORKERS / "dist_differential.py", 3, base / "w3", env=env) as three:
        three.wait(150)
        two.wait(60)
    yield {n: [json.loads((base / f"w{n}" / f"rank{r}.json").read_text()) for r in range(n)] for n in WORLDS}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", WORLDS)
def test_every_call_on_ringserve_gives_what_gloo_gives(ranks: dict[int, list[dict[str, Any]]], n: int) -> None:
    for r, got in enumerate(ranks[n]):
        assert not got["failed"], f"rank {r} of {n}: {len(got['failed'])} differences:\n" + "\n".join(
            f"  {name}: {why}" for name, why in got["failed"].items())
        assert len(got["passed"]) >= 180, f"rank {r} of {n} made only {len(got['passed'])} checks"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", WORLDS)
def test_every_family_of_calls_was_compared_on_every_rank_and_subgroup(ranks: dict[int, list[dict[str, Any]]],
                                                                      n: int) -> None:
    for r, got in enumerate(ranks[n]):
        names = set(got["passed"])
        missing = [m.format(n=n) for m in MUST + (ENDS if r < 2 else []) if m.format(n=n) not in names]
        assert not missing, f"rank {r} of {n} did not check {missing}"
        for members in GROUPS[n]:
            if r not in members:
                assert f"a non-member of {members} gets no group" in names
                continue
            prefix = f"group {members}: "
            checked = [name for name in names if name.startswith(prefix)]
            assert len(checked) >= 60, f"rank {r} of {n} checked {len(checked)} calls on {members}"
            for family in ("all_reduce ", "all_gather_coalesced", "reduce_scatter_tensor", "broadcast", "object"):
                assert any(name.startswith(prefix + family) for name in checked), (r, members, family)
