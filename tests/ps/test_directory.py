"""The coordinator's directory of shards: indices, leases and incarnations (coordinator/directory.py)."""

from __future__ import annotations

import pytest

from ringserve.coordinator.directory import Directory, NoFreeShardError, ShardIndexTakenError
from ringserve.errors import InvalidArgumentError


def test_shards_asking_for_any_index_take_the_lowest_free_ones_with_new_incarnations() -> None:
    d = Directory(lease_s=5.0)
    a = d.register("a", "h:1", shards=2, index=-1, first=True, now=0.0)
    b = d.register("b", "h:2", shards=2, index=-1, first=True, now=0.0)
    assert (a.index, b.index) == (0, 1) and a.incarnation != b.incarnation
    with pytest.raises(NoFreeShardError, match="All 2 shard indices are held"):
        d.register("c", "h:3", shards=2, index=-1, first=True, now=1.0)


def test_a_refresh_keeps_the_index_and_incarnation_and_a_restart_under_the_same_id_bumps_it() -> None:
    d = Directory(lease_s=5.0)
    first = d.register("a", "h:1", shards=1, index=-1, first=True, now=0.0)
    assert d.register("a", "h:1", shards=1, index=-1, first=False, now=1.0) == first
    again = d.register("a", "h:9", shards=1, index=0, first=True, now=2.0)
    assert again.index == 0 and again.incarnation > first.incarnation
    assert d.entries(2.0)[0][1].address == "h:9"


def test_a_lapsed_lease_frees_the_index_for_the_next_shard() -> None:
    d = Directory(lease_s=5.0)
    d.register("a", "h:1", shards=2, index=-1, first=True, now=0.0)
    d.register("b", "h:2", shards=2, index=-1, first=True, now=4.0)
    assert [alive for _, _, alive in d.entries(6.0)] == [False, True]
    assert d.register("c", "h:3", shards=2, index=-1, first=True, now=6.0).index == 0


def test_an_index_held_by_a_live_shard_is_refused_naming_the_holder() -> None:
    d = Directory(lease_s=5.0)
    d.register("a", "h:1", shards=2, index=1, first=True, now=0.0)
    with pytest.raises(ShardIndexTakenError, match="held by shard 'a' at h:1"):
        d.register("b", "h:2", shards=2, index=1, first=True, now=1.0)


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(shards=3, index=-1), "registers as one of 3 shards, but the job has 2"),
    (dict(shards=2, index=2), r"index 2 must be in \[0, 2\)"),
    (dict(shards=0, index=-1), r"\(0\) must be in \[1, 4096\]"),
])
def test_a_registration_that_disagrees_with_the_job_is_refused(kwargs: dict, named: str) -> None:
    d = Directory(lease_s=5.0)
    d.register("a", "h:1", shards=2, index=-1, first=True, now=0.0)
    with pytest.raises(InvalidArgumentError, match=named):
        d.register("b", "h:2", first=True, now=0.0, **kwargs)
