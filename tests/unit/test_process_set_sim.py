"""Process sets in the ring simulator (tests/ringsim.py): the shipped collectives face
(worker/faces/collectives.py) over simulated planes, so that registration (every rank's request gathered, then decided alike), the
choice of each collective's sub-ring, roots given as global ranks, and every kind of collective
over a set run exactly as they ship, concurrently with the whole view's and other sets', under
seeded random interleavings. Nothing here opens a socket.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np
import pytest
from reference import numpy_adasum, numpy_reduce
from ringsim import simulate

from ringserve.config import WorkerConfig
from ringserve.errors import InvalidArgumentError
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.session import Session
from ringserve.worker.faces.collectives import Collectives
from ringserve.worker.ops.process_sets import ProcessSet, WholeWorld

T = 10.0


class SimNode:
    """What the collectives face needs of a node (faces/collectives.PlaneSource), over one
    simulated plane: its config, no pin, and the plane itself."""

    def __init__(self, plane: Plane) -> None:
        self.config = WorkerConfig(chunk_bytes=16, collective_timeout_s=T, join_timeout_s=T)
        self.pinned: int | None = None
        self._plane = plane

    def plane(self) -> Plane:
        return self._plane


class SimWorker(Collectives):
    """The shipped collectives face over one simulated plane, as the Worker holds it."""

    def __init__(self, plane: Plane) -> None:
        super().__init__(SimNode(plane))
        self.global_process_set = WholeWorld(lambda: (plane.place.rank, plane.place.size))


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def x_of(rank: int, n: int = 11) -> np.ndarray:
    return (np.arange(n, dtype=np.float64) + 1) * (rank + 1)


def ints_of(rank: int, n: int) -> np.ndarray:
    return np.arange(3 * n + 1, dtype=np.int64).reshape(-1, 1) * (rank + 2)


def sets_of(world: int) -> list[list[int]]:
    """Even and odd ranks, and one overlapping both (ranks given unsorted)."""
    sets = [list(range(0, world, 2)), list(range(1, world, 2))]
    if world >= 3:
        sets.append([1, 0])
    return [s for s in sets if s and s != list(range(world))]


async def every_kind(w: SimWorker, ps: ProcessSet, tag: str) -> dict[str, Any]:
    """One collective of each kind over ``ps``, several in flight at once."""
    members, me = ps.ranks, w.plane().place.rank
    n = len(members)
    pos = members.index(me)
    x = x_of(me)
    splits = [(pos + d) % 3 for d in range(n)]
    rows = np.arange(sum(splits) * 2, dtype=np.int32).reshape(-1, 2) + 100 * me
    kinds = {
        "sum": w.allreduce(x, op="sum", name=f"{tag}.a", process_set=ps),
        "avg": w.allreduce(x, op="average", name=f"{tag}.a", compression="fp16", process_set=ps),
        "bcast": w.broadcast(x, root=members[-1], name=f"{tag}.b", process_set=ps),
        "gather": w.allgather(x[: pos + 1], name=f"{tag}.c", process_set=ps),
        "scatter": w.reduce_scatter(x, op="max", name=f"{tag}.d", process_set=ps),
        "a2a": w.alltoall(rows, splits=splits, name=f"{tag}.e", process_set=ps),
        "ggather": w.grouped_allgather([x[:1], rows[: pos + 1]], name=f"{tag}.f", process_set=ps),
        "gscatter": w.grouped_reduce_scatter([x, ints_of(me, n)], op="sum", name=f"{tag}.g",
                                             process_set=ps),
        "obj": w.broadcast_object({"from": me}, root=members[0], name=f"{tag}.h", process_set=ps),
        "objs": w.allgather_object(me, name=f"{tag}.i", process_set=ps),
        "barrier": w.barrier(process_set=ps),
    }
    if n & (n - 1) == 0:
        kinds["adasum"] = w.allreduce(x.astype(np.float32), op="adasum", name=f"{tag}.j", process_set=ps)
    outs = await asyncio.gather(*kinds.values())
    return dict(zip(kinds, outs, strict=True))


def check_every_kind(world: int, members: list[int], got: dict[str, Any], me: int) -> None:
    n, pos = len(members), members.index(me)
    xs = [x_of(m) for m in members]
    np.testing.assert_array_equal(got["sum"], numpy_reduce(xs, "sum"))
    np.testing.assert_allclose(got["avg"], numpy_reduce(xs, "average"), rtol=2e-3)
    np.testing.assert_array_equal(got["bcast"], x_of(members[-1]))
    np.testing.assert_array_equal(got["gather"], np.concatenate([x[: k + 1] for k, x in enumerate(xs)]))
    np.testing.assert_array_equal(got["scatter"], np.array_split(numpy_reduce(xs, "max"), n)[pos])
    # alltoall: member k sent splits[(k + d) % 3] rows to position d.
    split_of = [[(k + d) % 3 for d in range(n)] for k in range(n)]
    rows_of = [np.arange(sum(s) * 2, dtype=np.int32).reshape(-1, 2) + 100 * m for s, m in zip(split_of, members, strict=True)]
    received, counts = got["a2a"]
    expected = np.concatenate([r[sum(s[:pos]): sum(s[:pos]) + s[pos]] for r, s in zip(rows_of, split_of, strict=True)])
    np.testing.assert_array_equal(received, expected)
    assert counts.tolist() == [s[pos] for s in split_of]
    g1, g2 = got["ggather"]
    np.testing.assert_array_equal(g1, np.concatenate([x[:1] for x in xs]))
    np.testing.assert_array_equal(g2, np.concatenate([r[: k + 1] for k, r in enumerate(rows_of)]))
    s1, s2 = got["gscatter"]
    np.testing.assert_array_equal(s1, np.array_split(numpy_reduce(xs, "sum"), n)[pos])
    np.testing.assert_array_equal(s2, np.array_split(numpy_reduce([ints_of(m, n) for m in members], "sum"), n)[pos])
    assert got["obj"] == {"from": members[0]}
    assert got["objs"] == members
    assert got["barrier"] is None
    if "adasum" in got:
        np.testing.assert_allclose(got["adasum"], numpy_adasum([x.astype(np.float32) for x in xs]), rtol=1e-5)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
async def test_every_kind_of_collective_over_concurrent_sets_beside_the_whole_view(world: int) -> None:
    wanted = sets_of(world)

    async def rank(session: Session, r: int) -> tuple[list[ProcessSet], dict[int, dict[str, Any]], Any]:
        w = SimWorker(session.plane)
        sets = [await w.add_process_set(ranks) for ranks in wanted]
        mine = [ps for ps in sets if ps.included()]
        whole = w.allreduce(x_of(r), op="sum", name="whole", process_set=w.global_process_set)
        outs = await asyncio.gather(whole, *(every_kind(w, ps, f"s{ps.process_set_id}") for ps in mine))
        return sets, {ps.process_set_id: out for ps, out in zip(mine, outs[1:], strict=True)}, outs[0]

    results = await simulate(world, rank, seed=seed_of("sets", world))
    for r, (sets, per_set, whole) in enumerate(results):
        assert [ps.process_set_id for ps in sets] == list(range(1, len(wanted) + 1))  # the same ids everywhere
        np.testing.assert_array_equal(whole, numpy_reduce([x_of(k) for k in range(world)], "sum"))
        for ps in sets:
            if r in ps.ranks:
                check_every_kind(world, ps.ranks, per_set[ps.process_set_id], r)
            else:
                assert ps.process_set_id not in per_set


@pytest.mark.parametrize("world", [2, 3, 4, 5])
async def test_a_set_with_a_wrong_rank_is_refused_on_every_rank_and_the_view_goes_on(world: int) -> None:
    async def rank(session: Session, r: int) -> tuple[str, list[int]]:
        w = SimWorker(session.plane)
        # Only the last rank asks for a rank outside the view: every rank raises the same error.
        ranks = [0, world] if r == world - 1 else [0]
        with pytest.raises(InvalidArgumentError) as caught:
            await w.add_process_set(ranks)
        ps = await w.add_process_set([0])  # nothing was registered: id 1 is still free
        return str(caught.value), [ps.process_set_id, *w.process_sets()]

    results = await simulate(world, rank, seed=seed_of("wrong", world))
    assert len({text for text, _ in results}) == 1
    assert f"asked for ranks [0, {world}]" in results[0][0]
    assert all(ids == [1, 0, 1] for _, ids in results)


async def test_removed_ids_are_reused_and_a_removed_set_refuses_collectives() -> None:
    async def rank(session: Session, r: int) -> list[Any]:
        w = SimWorker(session.plane)
        a = await w.add_process_set([0, 1])
        b = await w.add_process_set([1, 2])
        await w.remove_process_set(a)
        with pytest.raises(InvalidArgumentError, match=r"not registered"):
            await w.allreduce(np.ones(2), process_set=a)
        c = await w.add_process_set([0, 2])
        with pytest.raises(InvalidArgumentError, match=r"global process set cannot be removed"):
            await w.remove_process_set(w.global_process_set)  # type: ignore[arg-type]
        return [a.process_set_id, b.process_set_id, c.process_set_id, w.process_sets()]

    results = await simulate(3, rank, seed=seed_of("reuse"))
    assert results == [[None, 2, 1, {0: [0, 1, 2], 1: [0, 2], 2: [1, 2]}]] * 3
