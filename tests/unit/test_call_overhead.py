"""What a collective's call computes once and then remembers: the plan, the descriptors of its
stages and algorithm, the sub-rings of a hierarchical allreduce. Each is a pure function of the
call and the view; a training loop asks the same questions every step, and answering them anew
was about a fifth of the CPU of a 64 KiB allreduce by host (docs/design/algorithms.md)."""

from __future__ import annotations

import pytest

from ringserve import selection
from ringserve.errors import InvalidArgumentError
from ringserve.selection import LinkCosts
from ringserve.worker.dataplane import keys, routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.dataplane.session import subring
from ringserve.worker.ops import planner

WAN = LinkCosts.of(0.020, 100e6 / 8)


def test_a_plan_asked_again_is_remembered_and_stays_the_same() -> None:
    first = selection.choose("auto", "allreduce", 64 << 10, 8, WAN, 2 << 20)
    hits = selection.choose.cache_info().hits
    again = selection.choose("auto", "allreduce", 64 << 10, 8, LinkCosts.of(0.020, 100e6 / 8), 2 << 20)
    assert again is first
    assert selection.choose.cache_info().hits == hits + 1
    # Another size or other links are other questions.
    assert selection.choose("auto", "allreduce", 64 << 20, 8, WAN, 2 << 20) != first
    assert selection.by_host(64 << 10, 2, 8, WAN, 2 << 20) is selection.by_host(64 << 10, 2, 8, WAN, 2 << 20)


def test_a_bad_setting_is_refused_every_time_not_remembered() -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="not one of"):
            selection.choose("fastest", "allreduce", 1024, 8, WAN, 2 << 20)


def test_a_stage_or_algorithm_of_the_same_call_is_the_same_descriptor_with_the_right_text() -> None:
    call = Descriptor("allreduce", "float32", (16384,), op="sum")
    stage = call.at_stage("cross")
    assert stage is Descriptor("allreduce", "float32", (16384,), op="sum").at_stage("cross")
    tagged = routes.tagged(stage, selection.RECURSIVE_DOUBLING)
    assert tagged.text == "allreduce float32 (16384,) op=sum stage=cross algo=recursive_doubling"
    assert Descriptor.parse(tagged.text) == tagged
    assert routes.untagged(tagged) == stage
    assert routes.tagged(stage, selection.RING).text == "allreduce float32 (16384,) op=sum stage=cross"
    refused = tagged.refused("shapes differ")
    assert refused.text.endswith("invalid: shapes differ") and refused is tagged.refused("shapes differ")


def _view(rank: int) -> Place:
    return Place(view_id=3, rank=rank, size=4, addresses=tuple(f"a{r}" for r in range(4)),
                 worker_ids=tuple(f"w{r}" for r in range(4)), hosts=(0, 0, 1, 1))


def test_a_sub_ring_is_remembered_per_view_and_members_and_still_checked() -> None:
    ring, spec, place = subring(_view(2), (0, 2))
    assert spec == keys.spec_of((0, 2))
    assert (ring.members, ring.index, place.rank, place.size, place.addresses, place.hosts) == (
        (0, 2), 1, 1, 2, ("a0", "a2"), (0, 1))
    assert subring(_view(2), (0, 2)) is subring(_view(2), (0, 2))
    assert subring(_view(0), (0, 2))[2].rank == 0  # another rank's view is another answer
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="not a member"):
            subring(_view(1), (0, 2))


def test_the_rings_by_host_are_remembered_per_hosts_and_rank() -> None:
    assert planner.topology(_view(3)) == ((2, 3), (1, 3))
    assert planner.topology(_view(3)) is planner.topology(_view(3))
    uneven = Place(view_id=3, rank=0, size=3, addresses=("a", "b", "c"), hosts=(0, 0, 1))
    assert planner.topology(uneven) is None
