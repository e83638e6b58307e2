"""Horovod's process-set API through ``ringserve.torch`` (and the numpy API beside it) on real worlds
of 3 and 4 processes (``workers/process_sets.py``): static sets from init, dynamic ones, the set's
view of itself, collectives over a set, DistributedOptimizer(process_set=), removal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _worlds import WORKERS, run_world

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=[3, pytest.param(4, marks=pytest.mark.slow)])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    n = request.param
    out: Path = tmp_path_factory.mktemp(f"process_sets{n}")
    run_world(WORKERS / "process_sets.py", n, out, timeout_s=150)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


def data(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) + 10 * rank


def test_init_registers_static_sets_all_or_none_and_again_without_error(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    for res in ranks:
        assert res["bad_init"].startswith("InvalidArgumentError") and "twice" in res["bad_init"]
        assert res["static"] == [f"ProcessSet(process_set_id=0, ranks={list(range(n))}, mpi_comm=None)",
                                 "ProcessSet(process_set_id=1, ranks=[0], mpi_comm=None)",
                                 f"ProcessSet(process_set_id=2, ranks={list(range(1, n))}, mpi_comm=None)"]
        assert res["static_ids"] == {0: list(range(n)), 1: [0], 2: list(range(1, n))}


def test_collectives_over_a_set_see_its_members_only(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    for r, res in enumerate(ranks):
        members = list(range(r % 2, n, 2))
        assert res["set_view"] == [len(members), members.index(r), True, False]
        assert torch.equal(res["sum"], sum(data(m) for m in members))
        assert torch.allclose(res["avg"], sum(data(m) for m in members) / len(members))
        assert res["gather"].tolist() == members
        assert res["bcast_obj"] == {"from": members[-1]} and res["gather_obj"] == members
        assert res["outsider"].startswith("InvalidArgumentError") and f"Rank {r} is not in process set" in res["outsider"]
        assert res["wrong_root"].startswith("InvalidArgumentError") and "root rank" in res["wrong_root"]


def test_the_optimizer_averages_over_its_set_and_outsiders_step_alone(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    for r in evens:
        assert torch.equal(ranks[r]["weights"], ranks[0]["weights"])
    for r in odds:
        assert not torch.allclose(ranks[r]["weights"], ranks[0]["weights"])  # its own gradients
    if len(odds) > 1:
        assert not torch.allclose(ranks[odds[0]]["weights"], ranks[odds[1]]["weights"])
    for r, res in enumerate(ranks):
        first = (evens if r % 2 == 0 else odds)[0]
        assert torch.equal(res["weights_after_bcast"], ranks[first]["weights"])


def test_the_numpy_api_shares_the_registry_and_removal_is_horovods(ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ranks):
        if r in (0, 1):
            assert res["np_sum"] == [3.0] * 3
            assert res["np_a2a"] == [0, 1]
        assert "global process set cannot be removed" in res["np_remove_global"]
        # The global set and a removed set: False, without a collective; a registered one: True.
        assert res["removed"] == [False, False, True, None]
        assert sorted(res["left"]) == [0, 1, 2, 3]  # global, the two static sets, the evens
