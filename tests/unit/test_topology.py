"""The shapes of the programs that are not rings (ringserve/topology.py): trees, folds, grids. Pure."""

from __future__ import annotations

import pytest

from ringserve import topology
from ringserve.worker.dataplane import routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import Ring, halving_doubling

SIZES = [*range(1, 70), 127, 128, 129, 255, 1000, 1023, 1024, 1025]


@pytest.mark.parametrize("n", SIZES)
def test_each_tree_is_one_tree_whose_parents_and_children_agree(n: int) -> None:
    roots = []
    for q in range(n):
        parent = topology.tree_parent(n, q)
        if parent < 0:
            roots.append(q)
        else:
            assert q in topology.tree_children(n, parent)
        for child in topology.tree_children(n, q):
            assert topology.tree_parent(n, child) == q
        assert len(topology.tree_children(n, q)) <= 2
    assert roots == [topology.power_below(n) - 1]


@pytest.mark.parametrize("n", SIZES)
def test_a_tree_is_no_deeper_than_log2_n_and_reaches_every_position(n: int) -> None:
    assert topology.tree_depth(n) <= max(n.bit_length() - 1, 0) + 1
    seen, todo = set(), [topology.power_below(n) - 1]
    while todo:
        q = todo.pop()
        seen.add(q)
        todo.extend(topology.tree_children(n, q))
    assert seen == set(range(n))


@pytest.mark.parametrize("n", [n for n in SIZES if n > 1])
def test_no_position_is_inside_both_trees_of_the_double_binary_tree(n: int) -> None:
    for pos in range(n):
        inside = [t for t in (0, 1) if topology.tree_links(n, pos, tree=t)[1]]
        assert len(inside) <= 1, f"position {pos} of {n} sends down both trees"


@pytest.mark.parametrize("n", [2, 3, 7, 8, 17, 100])
def test_a_rooted_tree_has_its_root_where_asked(n: int) -> None:
    for root in range(n):
        parents = [topology.tree_links(n, pos, root=root)[0] for pos in range(n)]
        assert [pos for pos, parent in enumerate(parents) if parent < 0] == [root]


@pytest.mark.parametrize("n", range(1, 40))
def test_the_fold_pairs_each_extra_position_with_one_that_stays_and_leaves_a_power_of_two(n: int) -> None:
    p = topology.power_below(n)
    vranks = []
    for pos in range(n):
        vrank, partner = topology.fold(n, pos)
        if vrank < 0:
            assert topology.fold(n, partner) == (topology.fold(n, partner)[0], pos)
        else:
            vranks.append(vrank)
            assert topology.position(n, vrank) == pos
    assert sorted(vranks) == list(range(p))


@pytest.mark.parametrize("p", [1, 2, 4, 8, 64])
def test_halving_gives_each_block_away_once_and_keeps_only_its_own(p: int) -> None:
    for vrank in range(p):
        held = set(range(p))
        for step in range(p.bit_length() - 1):
            kept = halving_doubling.kept(vrank, p, step)
            given = halving_doubling.given(vrank, p, step)
            assert set(kept) | set(given) == held and not set(kept) & set(given)
            # what a rank gives is what its partner keeps, in the order the partner takes it
            assert given == halving_doubling.kept(vrank ^ (p >> (step + 1)), p, step)
            held = set(kept)
        assert held == {vrank}


@pytest.mark.parametrize("p", [2, 4, 8, 32])
def test_doubling_brings_every_block_to_every_rank_once(p: int) -> None:
    for vrank in range(p):
        got = [vrank]
        for step in range(p.bit_length() - 1):
            got += halving_doubling.gather_order(vrank ^ (1 << step), step)
        assert sorted(got) == list(range(p))


@pytest.mark.parametrize("n", [1, 2, 4, 6, 7, 12, 16, 49, 1024])
def test_a_grid_is_the_factoring_closest_to_square(n: int) -> None:
    rows, cols = topology.grid(n)
    assert rows * cols == n and rows <= cols
    assert all(n % r or r > rows or r == rows for r in range(rows, int(n**0.5) + 1))


@pytest.mark.parametrize("algorithm", [routes.HALVING_DOUBLING, routes.TREE, routes.RING2D, "tree/3"])
def test_every_position_hears_from_each_position_that_sends_to_it(algorithm: str) -> None:
    n = 12
    rings = [Ring(tuple(range(n)), i) for i in range(n)]
    for i, ring in enumerate(rings):
        for j in routes.sinks(algorithm, ring):
            assert i in routes.sources(algorithm, rings[j]), f"{i} sends to {j}, which does not hear from it"


def test_an_unknown_algorithm_hears_from_the_ring_predecessor_only() -> None:
    ring = Ring(tuple(range(5)), 2)
    assert routes.sources("warp", ring) == {1} and routes.sinks("warp", ring) == {3}
    assert routes.algorithm_of("allreduce float32 (4,) op=sum") == routes.RING
    tree = routes.tagged(Descriptor("allreduce", dtype="float32", shape=(4,), op="sum"), "tree")
    assert tree.text == "allreduce float32 (4,) op=sum algo=tree" and Descriptor.parse(tree.text) == tree
    assert routes.algorithm_of(tree) == routes.algorithm_of(tree.text) == "tree"
    assert routes.untagged(routes.tagged(Descriptor("barrier"), "ring2d")).text == "barrier"
    refused = tree.refused("a problem that says algo=warp")
    assert routes.algorithm_of(refused.text) == "tree" and routes.algorithm_of(Descriptor("x", problem=" algo=warp").text) == routes.RING
