"""What ``auto`` plans by (selection.planned): static facts first (world, sizes, host layout), and
measured link figures by their class only, so that two runs of one job plan alike. Pure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringserve import selection
from ringserve.selection import HALVING_DOUBLING, HOST, LAN, RECURSIVE_DOUBLING, RING, RING2D, WAN, LinkCosts, Measured

MiB = 1 << 20
CHUNK = 2 * MiB
SIZES = (*(int(s) for s in np.geomspace(1 << 10, 256 * MiB, 25)), 0, 1_200_000)
WORLDS = range(2, 17)
# A loaded machine's loopback over eight rounds: 0.18 to 3 ms one way, 1.9 to 11 ns a byte. From
# the middle of it, every figure a tenth to ten times as large, each on its own.
LOOPBACK = (0.3e-3, 3e-9)
TENFOLD = (0.1, 0.3, 1.0, 3.0, 10.0)
# A WAN's figures only grow with load: from 10 ms, up to four times as slow.
WAN_FIGURES = (10e-3, 8e-9)
SLOWER = (1.0, 1.5, 2.0, 4.0)


def layouts(n: int) -> dict[str, tuple[int, ...]]:
    """Host layouts of n ranks: one host, a host each, hosts of two (n even), and not known."""
    found = {"one host": (0,) * n, "a host each": tuple(range(n)), "not known": ()}
    if n % 2 == 0:
        found["hosts of two"] = tuple(r // 2 for r in range(n))
    return found


def perturbed(base: tuple[float, float], factors: tuple[float, ...]) -> list[Measured]:
    return [Measured(base[0] * a, base[1] * b) for a, b in itertools.product(factors, factors)]


def plans(measured: Measured, n: int, hosts: tuple[int, ...], size: int) -> tuple[object, ...]:
    """Every decision auto makes for one call of ``size`` bytes over n ranks on ``hosts``."""
    links = selection.planned(measured, hosts=hosts, n=n)
    decided: list[object] = [selection.choose(setting, op, size, n, links, CHUNK, coded=coded)
                             for setting in (selection.AUTO, HALVING_DOUBLING)
                             for op in ("allreduce", "reduce_scatter", "allgather", "broadcast")
                             for coded in (False, True)]
    if hosts and len(set(hosts)) not in (1, n):  # by host, or flat over hosts (worker/ops/hierarchy.py)
        local, count = n // len(set(hosts)), len(set(hosts))
        decided += [selection.by_host(size, local, count, links, CHUNK),
                    selection.across_hosts(selection.AUTO, size, local, count, links, CHUNK),
                    selection.flat_plan(size, local, count, links, CHUNK)]
    return tuple(decided)


@pytest.mark.parametrize("n", WORLDS)
def test_links_measured_tenfold_apart_on_one_machine_plan_every_call_alike(n: int) -> None:
    for hosts in layouts(n).values():
        for size in SIZES:
            seen = {plans(measured, n, hosts, size) for measured in perturbed(LOOPBACK, TENFOLD)}
            assert len(seen) == 1, (n, hosts, size, seen)


@pytest.mark.parametrize("n", WORLDS)
def test_a_wan_measured_up_to_four_times_slower_plans_every_call_alike(n: int) -> None:
    for name, hosts in layouts(n).items():
        if name == "one host":
            continue
        for size in SIZES:
            seen = {plans(measured, n, hosts, size) for measured in perturbed(WAN_FIGURES, SLOWER)}
            assert len(seen) == 1, (n, hosts, size, seen)


def test_the_same_perturbations_taken_at_their_value_plan_apart() -> None:
    # What the classes take away: the raw figures, within the tenfold range above, change the plan.
    apart = 0
    for n in WORLDS:
        for size in SIZES:
            algorithms = {selection.choose("auto", "allreduce", size, n, LinkCosts(m.latency_s, m.seconds_per_byte),
                                           CHUNK).algorithm for m in perturbed(LOOPBACK, TENFOLD)}
            apart += len(algorithms) > 1
    assert apart > 50
    # The flake of 43b31c7: a 1.2 MB allreduce over 3 ranks planned a tree at 3-4 ms, the ring at 0.3.
    assert selection.choose("auto", "allreduce", 1_200_000, 3, LinkCosts(4e-3, 1e-9), CHUNK).algorithm != RING
    assert selection.choose("auto", "allreduce", 1_200_000, 3, LinkCosts(0.3e-3, 1e-9), CHUNK).algorithm == RING


def test_a_ring_on_one_host_is_never_a_wan_and_across_hosts_8_ms_one_way_makes_one() -> None:
    slow = Measured(50e-3, 1e-7)
    assert selection.link_class(slow, (7, 7, 7), 3) == HOST
    assert selection.link_class(slow, (0, 1, 2), 3) == WAN
    assert selection.link_class(slow, (), 3) == WAN  # hosts not known: the measure decides
    below = Measured(selection.WAN_LATENCY_S * 0.99, 1e-9)
    at = Measured(selection.WAN_LATENCY_S, 1e-9)
    assert selection.link_class(below, (0, 1), 2) == LAN and selection.link_class(at, (0, 1), 2) == WAN
    assert selection.link_class(at, (0, 0), 2) == HOST
    assert selection.planned(at, hosts=(0, 1), n=2) == selection.WAN_LINKS
    assert selection.planned(at, hosts=(0, 0), n=2) == selection.HOST_LINKS
    assert selection.planned(below, hosts=(), n=2) == selection.LAN_LINKS


def test_given_figures_are_a_static_fact_and_plan_at_their_value() -> None:
    given = LinkCosts.of(3e-3, 1e9)
    assert selection.planned(given, hosts=(0, 0, 0), n=3) is given
    assert selection.planned(given, hosts=(0, 1, 2), n=3) is given
    # Measured, the same figures are a LAN's; given, they are what the user says the links are.
    measured = Measured(given.latency_s, given.seconds_per_byte)
    assert measured != given
    assert selection.planned(measured, hosts=(0, 1, 2), n=3) == selection.LAN_LINKS


def algorithm(size: int, n: int, hosts: tuple[int, ...], measured: Measured | None = None) -> str:
    links = selection.planned(measured or Measured(*LOOPBACK), hosts=hosts, n=n)
    return selection.choose("auto", "allreduce", size, n, links, CHUNK).algorithm


def test_the_static_facts_change_the_plan_world_size_and_host_layout() -> None:
    apart = tuple(range(8))
    # the size
    assert algorithm(64 << 10, 4, (0, 1, 2, 3)) == RECURSIVE_DOUBLING
    assert algorithm(64 * MiB, 4, (0, 1, 2, 3)) == RING
    # the world
    assert algorithm(64 << 10, 3, (0, 1, 2)) == RING
    assert algorithm(64 << 10, 4, (0, 1, 2, 3)) == RECURSIVE_DOUBLING
    # the host layout: links that measure a WAN's latency are a WAN's across hosts, not on one host
    wan = Measured(20e-3, 8e-8)
    assert algorithm(MiB, 8, apart, wan) == HALVING_DOUBLING
    assert algorithm(MiB, 8, (0,) * 8, wan) == RING2D
    # ... and ranks sharing hosts run by host where it pays, on the same figures
    links = selection.planned(wan, hosts=tuple(r // 2 for r in range(16)), n=16)
    assert selection.by_host(64 << 10, 2, 8, links, CHUNK)
    assert not selection.by_host(64 * MiB, 2, 8, links, CHUNK)


@pytest.mark.parametrize(("n", "size", "expected"), [
    # between hosts on a LAN (benchmarks/allreduce.py --between-hosts, docs/design/payload-lane.md)
    (2, 64 << 10, RECURSIVE_DOUBLING), (2, 256 << 10, RECURSIVE_DOUBLING), (2, 64 * MiB, RING),
    (4, 64 << 10, RECURSIVE_DOUBLING), (4, MiB, RING), (4, 64 * MiB, RING),
    # a training step's buckets (DDP's 23, 16 and 6 MiB; the DistributedOptimizer's 4 MiB)
    (2, 23 * MiB, RING), (2, 16 * MiB, RING), (2, 6 * MiB, RING),
    (4, 23 * MiB, RING), (4, 16 * MiB, RING), (4, 6 * MiB, RING), (4, 4 * MiB, RING),
    (3, 1_200_000, RING),
])
def test_on_a_lan_or_one_host_the_benchmarks_calls_plan_as_they_did_on_a_quiet_machine(
        n: int, size: int, expected: str) -> None:
    for hosts in (tuple(range(n)), (0,) * n):
        for measured in perturbed(LOOPBACK, TENFOLD):
            assert algorithm(size, n, hosts, measured) == expected


@pytest.mark.parametrize("size", [MiB, 2 * MiB, 4 * MiB])
def test_over_two_ranks_a_mebibyte_or_more_runs_the_ring_between_hosts_and_recursive_doubling_on_one_host(
        size: int) -> None:
    # Recursive doubling reduces the whole vector where the ring reduces half, for the same bytes
    # sent. Between hosts, where a lane first reads the bytes into a buffer of their own, it took
    # 1.24x the ring's best time at 1 MiB and 1.13x at 4 MiB (veth, 16 interleaved rounds); on one
    # host, added in place from shared memory, 0.78x at 1 MiB (docs/design/algorithms.md).
    for measured in perturbed(LOOPBACK, TENFOLD):
        assert algorithm(size, 2, (0, 1), measured) == RING
        assert algorithm(size, 2, (), measured) == RING  # hosts not known: as between hosts
    assert algorithm(MiB, 2, (0, 0)) == RECURSIVE_DOUBLING
    assert algorithm(256 << 10, 2, (0, 1)) == RECURSIVE_DOUBLING  # small: the hop saved still wins


def test_on_a_wan_the_plans_are_those_of_the_documented_20_ms_100_mbit_links() -> None:
    documented = LinkCosts.of(0.020, 100e6 / 8, reduce_s=selection.REDUCE_RECEIVED_S)
    assert documented == selection.WAN_LINKS
    for n, size in itertools.product((2, 4, 8, 12, 16, 64, 100, 256, 1000, 1024), (4096, MiB, 64 * MiB)):
        measured = Measured(0.0201, 1 / (99e6 / 8))
        got = selection.choose("auto", "allreduce", size, n, selection.planned(measured, hosts=(), n=n), CHUNK)
        assert got == selection.choose("auto", "allreduce", size, n, documented, CHUNK)
    # 16 workers on 8 hosts (benchmarks/algorithms_wan.py): 64 KiB by host, 64 MiB over the flat ring
    links = selection.planned(Measured(0.0203, 9e-8), hosts=tuple(r // 2 for r in range(16)), n=16)
    assert selection.by_host(64 << 10, 2, 8, links, CHUNK)
    assert selection.flat_plan(64 * MiB, 2, 8, links, CHUNK).algorithm == RING
