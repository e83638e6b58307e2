"""Hosts and slots as horovodrun has them: parsing, numbering, blacklisting, elastic plans."""

from __future__ import annotations

import pytest

from ringserve.errors import InvalidArgumentError
from ringserve.launch.env import slot_env
from ringserve.launch.hosts import (
    Blacklist,
    HostSpec,
    Slot,
    assign_slots,
    host_order,
    parse_discovery_output,
    parse_host_list,
    parse_hostfile,
    plan_slots,
)


def test_a_host_list_gives_each_host_its_slots_in_order() -> None:
    assert parse_host_list("host1:4,host2:2, 10.0.0.3:1") == [
        HostSpec("host1", 4), HostSpec("host2", 2), HostSpec("10.0.0.3", 1),
    ]
    assert parse_host_list("a,b:3", default_slots=2) == [HostSpec("a", 2), HostSpec("b", 3)]
    assert parse_host_list("[fe80::1]:2,user@node-7:1") == [HostSpec("[fe80::1]", 2), HostSpec("user@node-7", 1)]


@pytest.mark.parametrize(("text", "said"), [
    ("host1:x", "'host1:x' in -H 'host1:x' must have the form name:slots"),
    ("host1:0", "'host1:0' in -H 'host1:0' must have at least one slot"),
    ("a:1,a:2", "'a' appears twice"),
    (",", "names no host"),
])
def test_a_bad_host_list_is_an_error_naming_the_entry(text: str, said: str) -> None:
    with pytest.raises(InvalidArgumentError, match=said):
        parse_host_list(text)


def test_a_hostfile_has_one_host_slots_n_per_line_with_comments_and_blank_lines() -> None:
    text = "# the cluster\nnode1 slots=4\n\nnode2   slots=2 max_slots=8  # small one\nnode3\n"
    assert parse_hostfile(text, "hosts.txt") == [HostSpec("node1", 4), HostSpec("node2", 2), HostSpec("node3", 1)]


@pytest.mark.parametrize(("text", "said"), [
    ("node1 slots=four\n", "Line 1 of hosts.txt .'node1 slots=four'. must have the form 'host slots=N'"),
    ("node1 cpus=4\n", "Line 1 of hosts.txt"),
    ("# nothing\n", "hosts.txt names no host"),
    ("n slots=1\nn slots=2\n", "'n' appears twice in hosts.txt"),
])
def test_a_bad_hostfile_line_is_an_error_naming_the_file_and_line(text: str, said: str) -> None:
    with pytest.raises(InvalidArgumentError, match=said):
        parse_hostfile(text, "hosts.txt")


def test_discovery_output_is_host_colon_slots_per_line_and_may_be_empty() -> None:
    assert parse_discovery_output("host-1:4\nhost-2:4\n\nhost-3\n", default_slots=2) == {
        "host-1": 4, "host-2": 4, "host-3": 2,
    }
    assert parse_discovery_output("\n") == {}
    with pytest.raises(InvalidArgumentError, match=r"host discovery script's output"):
        parse_discovery_output("host-1:many\n")


def test_slots_are_numbered_as_horovodrun_numbers_them() -> None:
    slots = assign_slots([HostSpec("a", 2), HostSpec("b", 3), HostSpec("c", 1)], 6)
    assert [(s.host, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 0, 2, 0, 3), ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 3, 1, 3), ("b", 3, 1, 3, 1, 2), ("b", 4, 2, 3, 0, 1),
        ("c", 5, 0, 1, 2, 3),
    ]
    assert {s.size for s in slots} == {6}


def test_fewer_processes_than_slots_fill_the_first_hosts_first() -> None:
    slots = assign_slots([HostSpec("a", 4), HostSpec("b", 4)], 5)
    assert [(s.host, s.local_rank, s.local_size) for s in slots] == [
        ("a", 0, 4), ("a", 1, 4), ("a", 2, 4), ("a", 3, 4), ("b", 0, 1),
    ]


def test_more_processes_than_slots_is_an_error_naming_both() -> None:
    with pytest.raises(InvalidArgumentError, match=r"-np 9 asks for more processes than the hosts have slots \(8: a:4,b:4\)"):
        assign_slots([HostSpec("a", 4), HostSpec("b", 4)], 9)


def test_a_slot_gives_horovods_variables() -> None:
    slot = Slot(host="b", rank=5, local_rank=1, local_size=4, cross_rank=1, cross_size=2, size=8)
    assert slot_env(slot) == {
        "HOROVOD_HOSTNAME": "b", "HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "4", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
    }


def test_without_a_cooldown_range_a_blacklisted_host_stays_out_for_good() -> None:
    blacklist = Blacklist()
    assert blacklist.add("a", now=10.0) is None
    assert blacklist.is_blacklisted("a", 1e9)
    assert not blacklist.is_blacklisted("b", 10.0)


def test_a_cooldown_doubles_with_each_blacklisting_up_to_the_maximum_plus_a_random_fraction_of_the_minimum() -> None:
    blacklist = Blacklist((10, 100), rand=lambda: 0.5)
    now = 0.0
    delays = []
    for _ in range(6):
        delay = blacklist.add("a", now)
        assert delay is not None
        delays.append(delay)
        assert blacklist.is_blacklisted("a", now + delay - 0.01)
        assert not blacklist.is_blacklisted("a", now + delay)
        now += delay
    assert delays == [15.0, 25.0, 45.0, 85.0, 100.0, 100.0]
    assert blacklist.times("a") == 6


def test_blacklisting_a_host_already_out_neither_extends_nor_counts() -> None:
    blacklist = Blacklist((10, 100), rand=lambda: 0.0)
    assert blacklist.add("a", 0.0) == 10.0
    assert blacklist.add("a", 4.0) == 6.0
    assert blacklist.times("a") == 1


@pytest.mark.parametrize("bounds", [(0, 10), (10, 5), (1, 3601)])
def test_a_cooldown_range_out_of_horovods_bounds_is_an_error(bounds: tuple[int, int]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"--blacklist-cooldown-range"):
        Blacklist(bounds)


def test_hosts_in_the_run_keep_their_places_and_new_ones_follow() -> None:
    assert host_order(["b", "a"], ["a", "c", "b"]) == ["b", "a", "c"]
    assert host_order(["b", "a"], ["c", "a"]) == ["a", "c"]


def test_the_plan_fills_hosts_in_order_up_to_max_np_skipping_blacklisted_ones() -> None:
    slots = {"a": 2, "b": 2, "c": 2}
    assert plan_slots(["a", "b", "c"], slots, 5, lambda h: False) == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0),
    ]
    assert plan_slots(["a", "b", "c"], slots, 8, lambda h: h == "b") == [("a", 0), ("a", 1), ("c", 0), ("c", 1)]
    assert plan_slots(["a", "gone"], slots, 8, lambda h: False) == [("a", 0), ("a", 1)]
