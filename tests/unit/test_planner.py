"""The planner (ringserve/worker/ops/planner.py): one pure plan per call, made before anything
runs, alike on every rank of a ring, and the only place that chooses."""

from __future__ import annotations

import ast
import pathlib

import pytest

from ringserve import selection
from ringserve.ring import segment_bounds
from ringserve.selection import HALVING_DOUBLING, RECURSIVE_DOUBLING, RING, TREE, LinkCosts
from ringserve.worker.ops import planner
from ringserve.worker.ops.planner import ACROSS, BY_HOST, CROSS, LOCAL, LOCAL_GATHER, LOCAL_REDUCE, VIEW, Call, Ground

LAN = selection.LAN_LINKS
WAN = selection.WAN_LINKS
MIB = 1 << 20
CHUNK = 1 << 20


def floats(count: int, codec: str = "") -> Call:
    wire = count * 2 if codec else count * 4
    return Call("allreduce", count, 4, wire, codec)


def view(hosts: tuple[int, ...], rank: int = 0, algorithm: str = "auto", hierarchical: str = "auto") -> Ground:
    return Ground(len(hosts), rank, hosts, algorithm, hierarchical)


def test_the_ring_setting_plans_the_ring_in_its_own_chunks_and_reads_no_figures() -> None:
    ground = view((0, 1, 2, 3), algorithm="ring", hierarchical="0")
    assert not ground.needs_figures
    plan = planner.plan(floats(16 * MIB), ground, None, CHUNK)
    assert (plan.algorithm, plan.by_host) == (RING, False)
    # Every rank on a host of its own: wider frames (selection.ring_chunk).
    assert plan.stage == planner.Stage("", VIEW, RING, selection.ring_chunk(64 * MIB, 4, CHUNK, apart=True) // 4)
    assert plan.stage.chunk_elems == 4 * CHUNK // 4
    one_host = planner.plan(floats(16 * MIB), view((0, 0, 0, 0), algorithm="ring", hierarchical="0"), None, CHUNK)
    assert one_host.stage.chunk_elems == CHUNK // 4


def test_a_plan_is_remembered_and_equal_questions_get_the_same_plan() -> None:
    first = planner.plan(floats(4096), view((0, 1, 2, 3)), LAN, CHUNK)
    hits = planner.plan.cache_info().hits
    equal = LinkCosts.of(50e-6, 10e9 / 8, reduce_s=selection.REDUCE_RECEIVED_S)
    assert planner.plan(floats(4096), view((0, 1, 2, 3)), equal, CHUNK) is first
    assert planner.plan.cache_info().hits == hits + 1


@pytest.mark.parametrize("hosts", [(0, 1, 2, 3, 4, 5, 6, 7), (0, 0, 1, 1, 2, 2, 3, 3), (0, 0, 0, 1, 1, 1)])
@pytest.mark.parametrize("links", [LAN, WAN])
@pytest.mark.parametrize("setting", ["auto", "halving_doubling", "tree", "ring2d", "ring"])
@pytest.mark.parametrize("count", [1, 1000, 16384, 4 * MIB + 3])
def test_every_rank_of_a_view_plans_the_same_algorithms_and_stages(hosts, links, setting, count) -> None:
    plans = [planner.plan(floats(count), view(hosts, rank, setting), links, CHUNK) for rank in range(len(hosts))]
    shapes = {(p.algorithm, tuple((s.name, s.ring, s.algorithm) for s in p.stages)) for p in plans}
    assert len(shapes) == 1, shapes
    flat = [p for p in plans if not p.by_host]
    assert len({p.stage.chunk_elems for p in flat}) <= 1
    # By host, a stage's chunk is alike within each of its rings: the local stages everywhere, the
    # stage across hosts at each local position (its slice of the tensor).
    for plan in plans:
        if plan.algorithm == BY_HOST:
            assert plan.rings is not None
            mates = [plans[r] for r in plan.rings[1]]
            assert {m.stages[1].chunk_elems for m in mates} == {plan.stages[1].chunk_elems}


def test_by_host_runs_three_stages_over_the_hosts_rings_with_the_slice_chunked_as_a_ring_across_hosts() -> None:
    hosts = (0, 0, 1, 1, 2, 2)
    count = 3 * MIB + 1
    plan = planner.plan(floats(count), view(hosts, 3, "ring", "1"), None, CHUNK)
    assert plan.algorithm == BY_HOST and plan.rings == ((2, 3), (1, 3, 5))
    assert [(s.name, s.ring, s.algorithm) for s in plan.stages] == [
        (LOCAL_REDUCE, LOCAL, RING), (ACROSS, CROSS, RING), (LOCAL_GATHER, LOCAL, RING)]
    a, b = segment_bounds(count, 2)[1]
    across = selection.ring_chunk((b - a) * 4, 3, CHUNK, apart=True) // 4
    assert [s.chunk_elems for s in plan.stages] == [CHUNK // 4, across, CHUNK // 4]


def test_by_host_across_a_wan_is_one_program_where_doubling_crosses_hosts_of_consecutive_ranks() -> None:
    small = floats(16384)  # 64 KiB: latency, not bytes
    fused = planner.plan(small, view((0, 0, 1, 1, 2, 2, 3, 3), 5), WAN, CHUNK)
    assert fused.by_host and fused.stage == planner.Stage("", VIEW, "host_doubling/2", CHUNK // 4)
    # The same hosts, ranks not consecutive: recursive doubling as the stage across hosts.
    spread = planner.plan(small, view((0, 1, 2, 3, 0, 1, 2, 3), 5), WAN, CHUNK)
    assert spread.algorithm == BY_HOST and spread.stages[1].algorithm == RECURSIVE_DOUBLING
    # Three hosts: a tree across them, in its own chunks.
    tree = planner.plan(small, view((0, 0, 1, 1, 2, 2), 0), WAN, CHUNK)
    assert tree.algorithm == BY_HOST and tree.stages[1].algorithm == TREE
    assert tree.stages[1].chunk_elems == selection.tree_chunk(32 << 10, 3, CHUNK) // 4


def test_auto_runs_flat_where_by_host_does_not_pay_and_a_codec_never_by_host() -> None:
    large = floats(16 * MIB)
    hosts = (0, 0, 1, 1, 2, 2, 3, 3)
    assert not selection.by_host(64 * MIB, 2, 4, WAN, CHUNK)  # the flat ring crosses each uplink once
    plan = planner.plan(large, view(hosts), WAN, CHUNK)
    assert not plan.by_host and plan.algorithm == RING
    assert plan.stage.chunk_elems == CHUNK // 4  # not every rank on a host of its own: plain chunks
    # Forced by host ("1") runs by host whatever the model says.
    assert planner.plan(large, view(hosts, hierarchical="1"), WAN, CHUNK).by_host
    coded = planner.plan(floats(16384, "fp16"), view(hosts, hierarchical="1"), WAN, CHUNK)
    assert not coded.by_host and coded.codec == "fp16"
    assert coded.algorithm != RECURSIVE_DOUBLING  # left out under a codec (selection.candidates)


@pytest.mark.parametrize("hosts", [(0, 0), (0, 1), (0, 0, 0, 0), (0, 1, 2, 3)])
def test_where_auto_runs_the_ring_it_runs_the_ring_settings_plan_exactly(hosts: tuple[int, ...]) -> None:
    # So that a benchmark's auto / ring is 1 in those cells but for noise (docs/benchmarks/allreduce.md).
    links = selection.planned(selection.Measured(0.3e-3, 3e-9), hosts=hosts, n=len(hosts))
    ringed = 0
    for size in (1, 4096, 65536, MIB, 16 * MIB, 64 * MIB + 12):
        for rank in range(len(hosts)):
            auto = planner.plan(floats(size), view(hosts, rank), links, 2 * MIB)
            if auto.algorithm == RING:
                ringed += 1
                assert auto == planner.plan(floats(size), view(hosts, rank, "ring", "0"), None, 2 * MIB)
    assert ringed


@pytest.mark.parametrize(("local", "expected"), [
    (2, ("host_doubling/2", "host_doubling/2", BY_HOST, RING, RING)),
    (4, ("host_doubling/4", "host_doubling/4", "host_doubling/4", "host_doubling/4", BY_HOST)),
])
def test_hosts_of_several_ranks_on_a_lan_plan_by_host_as_measured(local: int, expected: tuple[str, ...]) -> None:
    # 8 ranks between hosts (veth, 2026-12-06): each of these plans took 0.22x to 1.02x the flat
    # ring's time (median of 5 rounds); at 2 hosts of 4 and 16 MiB the three stages, which a cost
    # per byte reduced had made the model prefer, took 1.48x (docs/benchmarks/allreduce.md). 4 hosts
    # of 2 at 16 MiB by host took 0.88-1.29x the flat ring over five runs: it runs the ring now.
    hosts = tuple(r // local for r in range(8))
    links = selection.planned(selection.Measured(0.3e-3, 3e-9), hosts=hosts, n=8)
    got = tuple(planner.plan(floats(size // 4), view(hosts), links, 2 * MIB).algorithm
                for size in (4096, 65536, MIB, 16 * MIB, 64 * MIB))
    assert got == expected


def test_the_other_ops_plan_as_the_cost_model_says() -> None:
    pow2 = view(tuple(range(8)))
    rs = planner.plan(Call("reduce_scatter", 1024, 4, 4096), pow2, WAN, CHUNK)
    assert rs.algorithm == HALVING_DOUBLING and rs.stage.chunk_elems == CHUNK // 4
    three = view(tuple(range(3)))
    assert planner.plan(Call("reduce_scatter", 1024, 4, 4096), three, WAN, CHUNK).algorithm == RING
    assert planner.plan(Call("allgather", itemsize=4), pow2, WAN, CHUNK).algorithm == HALVING_DOUBLING
    assert planner.plan(Call("broadcast", itemsize=1), pow2, WAN, CHUNK).algorithm == TREE
    barrier = planner.plan(Call("barrier", 1, 4, 4), pow2, WAN, 4)
    assert barrier.stage.chunk_elems == 1 and not barrier.by_host
    with pytest.raises(ValueError, match="No plan for the op 'alltoall'"):
        planner.plan(Call("alltoall"), pow2, WAN, CHUNK)


def test_a_rank_that_stands_in_chunks_the_others_algorithm_as_they_do() -> None:
    ground = view((0, 1, 2, 3, 4))
    theirs = planner.plan(floats(MIB), ground, WAN, CHUNK)
    assert planner.flat(theirs.algorithm, floats(MIB), ground, CHUNK) == theirs


# The choices are made in planner.py (by selection.py's model) and nowhere downstream: the modules
# that carry a plan out call none of the choosing functions.
CHOOSERS = {"choose", "by_host", "flat_plan", "across_hosts", "ring_chunk", "tree_chunk", "predict", "chosen",
            "topology", "consecutive", "plan"}
RUNNERS = ("worker/ops/collectives.py", "worker/ops/algorithms.py", "worker/ops/hierarchy.py", "worker/ops/join.py",
           "worker/ops/grouped.py", "worker/ops/process_sets.py", "worker/dataplane/programs/executor.py")


@pytest.mark.parametrize("module", RUNNERS)
def test_nothing_downstream_of_the_planner_chooses_again(module: str) -> None:
    root = pathlib.Path(planner.__file__).resolve().parents[2]
    tree = ast.parse((root / module).read_text())
    calls = [node.func for node in ast.walk(tree) if isinstance(node, ast.Call)]
    chosen = [f"{f.value.id}.{f.attr}" for f in calls if isinstance(f, ast.Attribute)
              and isinstance(f.value, ast.Name) and f.value.id in ("selection", "planner") and f.attr in CHOOSERS]
    allowed = {"planner.plan"} if module.endswith("algorithms.py") else set()  # the one call, in algorithms.plan
    assert set(chosen) <= allowed, f"{module} chooses again: {chosen}"
