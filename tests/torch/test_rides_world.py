"""A commit's check carried by the next step's gradient allreduce (ringserve.elastic.rider), on a
real world of three processes (workers/rides.py).

- The flags that one rank sets come back above zero on every rank, through every reduction the
  optimizer's buckets use that carries them (plain, fp16, bf16, the int8 codec, PowerSGD, a
  predivide factor, Sum).
- A rank that heals (its state on its way, rider.begin_heal) sends zeros, and every rank's step
  is the average (or the sum) of the others' gradients; the heal's load runs once, after the
  step's reductions, on that rank only; also where it started that step ahead of its backward
  pass (``heal_ahead``), with gradients that were views of its buckets, or with a commit between.
- A commit followed by a step costs no allreduce of its own; commits with no step between them
  fall back to the check's own allreduce; a user's compressor (which might not keep a 0 and a 1
  apart) carries nothing, and its commits run their own check.
"""

from __future__ import annotations

import json

import pytest
from _worlds import WORKERS, RunWorld

N = 3

pytestmark = pytest.mark.timeout(180)


def test_a_commits_check_rides_on_the_gradient_allreduce_and_falls_back_where_nothing_carries_it(
        world_runner: RunWorld) -> None:
    run = world_runner(WORKERS / "rides.py", N, timeout_s=120)
    ranks = [json.loads((run.out_dir / f"rank{r}.json").read_text()) for r in range(N)]
    for rank in ranks:
        for kind, got in rank["answers"].items():
            assert got["carries"], f"{kind}: the optimizer does not carry rides"
            assert got["answer"] == [True, False], f"{kind}: the last rank's flag came back as {got['answer']}"
            assert got["answered"] == 1, f"{kind}: the answer was announced {got['answered']} times"
            assert got["buckets"] > 1, f"{kind}: one bucket carried the ride"
        assert rank["steady"] == 1.0, f"{rank['steady']} allreduces a commit with a step between: the check did not ride"
        assert rank["no_step"] == 1.0, f"{rank['no_step']} allreduces a commit with no step: no check of its own ran"
    assert len({rank["sha"] for rank in ranks}) == 1, "the replicas' parameters differ"
    for r, rank in enumerate(ranks):
        for kind, got in rank["healing"].items():
            # A rank that heals sends zeros; the others' average (or sum) is every rank's gradient.
            assert got["error"] <= got["tolerance"] * max(1.0, got["scale"]), f"rank {r}, {kind}: {got}"
            assert got["loads"] == ([True] if r == N - 1 else []), f"rank {r}, {kind}: the heal's load ran {got['loads']}"
            assert not got["healing_after"], f"rank {r}, {kind}: still healing after the step"
        assert {"plain.ahead", "sum.ahead", "sparse.ahead"} <= set(rank["healing"])
        # Started ahead, then a commit: the step's buckets carried its check on every rank alike.
        ahead = rank["ahead_commit"]
        assert ahead["allreduces"] == 1 + ahead["buckets"], f"rank {r}: {ahead}"
        assert ahead["loads"] == ([True] if r == N - 1 else []), f"rank {r}: {ahead}"
        # A commit between the backward pass and the step: no step carried either commit's check,
        # so each ran its own allreduce, on every rank alike (else the healer skips one: a hang).
        mid = rank["ahead_commit_mid"]
        assert mid["allreduces"] == 2 + mid["buckets"], f"rank {r}: {mid}"
        assert mid["loads"] == ([True] if r == N - 1 else []), f"rank {r}: {mid}"


def test_a_users_compressor_carries_no_ride_and_each_commit_runs_its_own_check(world_runner: RunWorld) -> None:
    run = world_runner(WORKERS / "rides.py", N, "user", timeout_s=120)
    ranks = [json.loads((run.out_dir / f"rank{r}.json").read_text()) for r in range(N)]
    for rank in ranks:
        assert rank["user_compressor"] == 2.0, f"{rank['user_compressor']} allreduces a commit with a user's compressor"
    assert len({rank["sha"] for rank in ranks}) == 1, "the replicas' parameters differ"
