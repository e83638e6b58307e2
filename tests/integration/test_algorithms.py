"""Every algorithm with real workers over real sockets: the same bytes as the ring where sums are
exact, codecs within their bounds, process sets, join, the algorithm named on the timeline and in
the metrics, and ranks that disagree on the algorithm failing with MismatchError."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce

from ringserve import MismatchError, Worker, selection
from ringserve.selection import HALVING_DOUBLING, RECURSIVE_DOUBLING, RING, RING2D, TREE

pytestmark = pytest.mark.timeout(120)

# Link figures given (a WAN's): every run plans alike, with no measure of the links first.
WAN = {"link_latency_s": 0.02, "link_mbps": 100.0}


def exact_inputs(n: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-100, 100, length).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize(("n", "setting"), [(4, HALVING_DOUBLING), (5, HALVING_DOUBLING), (6, TREE), (6, RING2D)])
async def test_each_algorithm_gives_every_worker_the_rings_bytes_and_names_itself(world_factory, n: int,
                                                                                   setting: str) -> None:
    world = await world_factory(n, algorithm=setting, chunk_bytes=4096, **WAN)
    ring = await world_factory(n, algorithm=RING, chunk_bytes=4096)
    for length, seed in ((1, 1), (n + 1, 2), (40_000, 3)):  # one element, a few, several chunks a block
        xs = exact_inputs(n, length, seed)
        got = await world.map("allreduce", xs, op="sum", name="x")
        want = await ring.map("allreduce", xs, op="sum", name="x")
        for out in got:
            assert out.tobytes() == want[0].tobytes()
        np.testing.assert_array_equal(got[0], numpy_reduce(xs, "sum"))
    for w in world.workers:
        used = {a for (op, a) in w.counters.algorithms if op == "allreduce"}
        assert used <= {setting, RECURSIVE_DOUBLING} and used, used


async def test_a_power_of_two_world_reduce_scatters_gathers_and_broadcasts_by_its_algorithms(world_factory) -> None:
    n = 4
    world = await world_factory(n, chunk_bytes=4096, **WAN)  # auto
    xs = [np.arange(9 * 3, dtype=np.int64).reshape(9, 3) * (r + 1) for r in range(n)]
    parts = await world.map("reduce_scatter", xs, op="sum", name="rs")
    for r, part in enumerate(parts):
        np.testing.assert_array_equal(part, np.array_split(sum(xs), n)[r])
    gathered = await world.map("allgather", [np.full((r + 1, 2), r) for r in range(n)], name="ag")
    for out in gathered:
        np.testing.assert_array_equal(out, np.concatenate([np.full((r + 1, 2), r) for r in range(n)]))
    sent = await world.each(lambda w: w.broadcast(np.arange(5) if w.rank == 2 else np.zeros(5, dtype=np.int64),
                                                  root=2, name="bc"))
    for out in sent:
        np.testing.assert_array_equal(out, np.arange(5))
    kinds = {key for key in world.workers[0].counters.algorithms}
    assert {("reduce_scatter", HALVING_DOUBLING), ("allgather", HALVING_DOUBLING), ("broadcast", "tree/2")} <= kinds


@pytest.mark.parametrize("codec", ["fp16", "int8"])
async def test_under_a_codec_a_tree_stays_within_the_codecs_bound_and_feedback_keeps_the_loss(
        world_factory, codec: str) -> None:
    n = 5
    world = await world_factory(n, algorithm=TREE, chunk_bytes=4096, **WAN)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(3000).astype(np.float32) for _ in range(n)]
    residuals = [np.zeros(3000, dtype=np.float32) for _ in range(n)]
    outs = await world.each(lambda w: w.allreduce(xs[w.rank], op="sum", name="c", compression=codec,
                                                  residual=residuals[w.rank]))
    for out in outs:
        assert out.tobytes() == outs[0].tobytes()
    exact = numpy_reduce([x.astype(np.float64) for x in xs], "sum")
    scale = np.abs(np.stack(xs)).sum(axis=0).max()
    np.testing.assert_allclose(outs[0], exact, atol=0.02 * scale)
    np.testing.assert_allclose(outs[0] + sum(residuals), exact, atol=1e-4 * scale * n)


async def test_process_sets_run_their_own_algorithm_over_their_sub_rings(world_factory) -> None:
    n = 6
    world = await world_factory(n, algorithm=TREE, chunk_bytes=4096, **WAN)

    async def call(w: Worker) -> Any:
        evens = await w.add_process_set([0, 2, 4])
        out = await w.allreduce(np.full(100, float(w.rank)), op="sum", name="s", process_set=evens) \
            if w.rank % 2 == 0 else None
        whole = await w.allreduce(np.full(100, float(w.rank)), op="sum", name="w")
        return out, whole

    outs = await world.each(call)
    for r, (part, whole) in enumerate(outs):
        np.testing.assert_array_equal(whole, np.full(100, float(sum(range(n)))))
        if r % 2 == 0:
            np.testing.assert_array_equal(part, np.full(100, 6.0))


async def test_a_tree_world_whose_workers_join_early_adds_zeros_for_them(world_factory) -> None:
    n = 5
    world = await world_factory(n, algorithm=TREE, chunk_bytes=4096, **WAN)

    async def call(w: Worker) -> tuple[list[np.ndarray], int]:
        sums = [await w.allreduce(np.full(300, w.rank + 1.0), op="sum", name=f"j/{step}")
                for step in range(w.rank + 1)]
        return sums, await w.join()

    for sums, last in await world.each(call, timeout_s=60):
        assert last == n - 1
        for step, got in enumerate(sums):
            np.testing.assert_array_equal(got, np.full(300, float(sum(k + 1 for k in range(step, n)))))


async def test_workers_that_disagree_on_the_algorithm_fail_with_a_mismatch_naming_it(world_factory) -> None:
    world = await world_factory(3, each=lambda i: {"algorithm": RING if i == 2 else TREE}, **WAN)
    outcomes = await world.each_outcome(lambda w: w.allreduce(np.ones(10, dtype=np.float32), name="m"), timeout_s=20)
    for outcome in outcomes:
        assert isinstance(outcome, MismatchError)
        # two ranks' arguments name the tree, one's (the ring's) no algorithm
        assert str(outcome).count("op=average algo=tree") == 2
        assert re.search(r"rank \d: allreduce float32 \(10,\) op=average[;)]", str(outcome)), outcome


async def test_auto_measures_the_links_once_per_view_and_the_timeline_names_the_algorithm(
        world_factory, tmp_path: Path) -> None:
    template = str(tmp_path / "trace")
    # auto, links measured: a ring across two hosts (on one, nothing is measured: see below)
    world = await world_factory(4, timeline=template, each=lambda i: {"hostname": f"host-{i // 2}"})
    for _ in range(2):
        await world.map("allreduce", [np.ones(8, dtype=np.float32)] * 4, op="sum", name="t")
    measured = [await w.node.planes.current.measures.links(w.node.planes.current.session())  # type: ignore[union-attr]
                for w in world.workers]
    assert len({(m.latency_s, m.seconds_per_byte) for m in measured}) == 1  # agreed, bit for bit
    assert 0 < measured[0].latency_s < 1.0
    assert sum(n for (op, _), n in world.workers[0].counters.algorithms.items() if op == "links") == 1
    await world.close()
    events = json.loads(Path(f"{template}.0.json").read_text())
    # Across hosts the plan may run in stages (hier:local-reduce, cross, local-gather), each a span
    # of its own under the collective's key; which stages depends on the class the measure read.
    spans = [e for e in events if e.get("name", "").startswith("allreduce t#")]
    assert all("algorithm" in e["args"] for e in spans)
    by_key = Counter(e["args"]["op_key"].split("/", 1)[0] for e in spans)
    assert set(by_key) == {"t#1", "t#2"} and by_key["t#1"] == by_key["t#2"], by_key


async def test_auto_measures_nothing_on_a_ring_of_one_host_whose_class_no_measure_changes(world_factory) -> None:
    # selection.link_class: HOST whatever was measured. The measure cost every view's first
    # collective about 25 ms, which each joiner's admission made the members pay (issue 45).
    world = await world_factory(3)
    await world.map("allreduce", [np.ones(8, dtype=np.float32)] * 3, op="sum", name="t")
    assert all(not any(op == "links" for op, _ in w.counters.algorithms) for w in world.workers)
    figures = [await w.node.planes.current.measures.links(w.node.planes.current.session())  # type: ignore[union-attr]
               for w in world.workers]
    assert all(selection.planned(f, hosts=(0, 0, 0), n=3) == selection.HOST_LINKS for f in figures)
