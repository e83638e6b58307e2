"""ringserve.ray's decisions and its actor as a plain class: no Ray, no cluster (the real cluster's
tests are tests/raycluster, marker ``ray``)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from worlds import coordinator_config

from ringserve import InvalidArgumentError, RingChangedError
from ringserve.ray import outcomes
from ringserve.ray.actor import WorkerActor, is_recoverable
from ringserve.ray.settings import RaySettings, RayWorkerError

Outcome = outcomes.Outcome


def test_the_failure_reported_is_the_first_that_is_not_a_consequence_of_another() -> None:
    echo = Outcome(0, ok=False, error="RingChangedError: ...", recoverable=True)
    cause = Outcome(2, ok=False, error="ValueError: bad batch")
    death = Outcome(1, ok=False, died=True, error="the actor died")
    assert outcomes.primary([echo, cause, death]) is cause
    assert outcomes.primary([echo, death]) is death
    assert outcomes.primary([echo]) is echo
    with pytest.raises(ValueError, match="no failure"):
        outcomes.primary([])


def test_results_come_in_the_rank_they_ended_in_and_those_without_one_last_by_slot() -> None:
    done = [Outcome(3, ok=True, value="c", rank=None), Outcome(0, ok=True, value="b", rank=1, size=3),
            Outcome(2, ok=True, value="a", rank=0, size=3), Outcome(1, ok=True, value="d", rank=None)]
    assert outcomes.in_rank_order(done) == ["a", "b", "d", "c"]


def test_dead_actors_are_replaced_within_the_reset_limit_and_never_once_a_rank_returned() -> None:
    plan = outcomes.Elastic(reset_limit=2)
    dead = Outcome(1, ok=False, died=True)
    assert [plan.on_death(dead) for _ in range(3)] == [True, True, False]
    unlimited = outcomes.Elastic(reset_limit=None)
    assert all(unlimited.on_death(dead) for _ in range(50))
    unlimited.on_return(Outcome(0, ok=True, rank=0, size=2))
    assert unlimited.finishing and not unlimited.on_death(dead)


def test_the_run_is_complete_once_the_final_views_members_all_returned_or_the_world_is_empty() -> None:
    plan = outcomes.Elastic(reset_limit=None)
    assert not plan.complete(world_empty=True), "nobody returned yet"
    plan.on_return(Outcome(0, ok=True, rank=0, size=3))
    plan.on_return(Outcome(2, ok=True, rank=2, size=3))
    assert not plan.complete(world_empty=False)
    plan.on_return(Outcome(1, ok=True, rank=1, size=3))
    assert plan.complete(world_empty=False)
    unknown = outcomes.Elastic(reset_limit=None)
    unknown.on_return(Outcome(0, ok=True))  # its function shut ringserve down: its view is unknown
    assert not unknown.complete(world_empty=False) and unknown.complete(world_empty=True)


def test_settings_name_a_bad_timeout_and_a_worker_error_names_its_rank() -> None:
    with pytest.raises(InvalidArgumentError, match=r"RaySettings.timeout_s \(0"):
        RaySettings(timeout_s=0)
    error = RayWorkerError(3, "ValueError: no", died=False)
    assert error.rank == 3 and "rank 3 of the RayExecutor failed: ValueError: no" in str(error)
    assert "died" in str(RayWorkerError(1, "lost", died=True))


def test_recoverable_errors_are_told_apart_from_the_programs_own() -> None:
    assert is_recoverable(RingChangedError(1, 2))
    assert not is_recoverable(ValueError("x")) and not is_recoverable(None)


def test_an_actor_runs_functions_in_its_environment_and_leaves_the_world_when_one_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve import api
    from ringserve.coordinator import Coordinator
    from ringserve.loop import LoopThread

    # The actor sets these in its process's environment: here, they are put back after the test.
    for name in ("RINGSERVE_COORDINATOR", "RINGSERVE_USE_UVLOOP", "RINGSERVE_BIND_HOST", "RINGSERVE_ADVERTISE_HOST"):
        monkeypatch.delenv(name, raising=False)
    thread = LoopThread(use_uvloop=False)
    coordinator = thread.run(Coordinator(coordinator_config(min_workers=1)).start(), 30)
    try:
        actor = WorkerActor({"RINGSERVE_COORDINATOR": coordinator.address, "RINGSERVE_USE_UVLOOP": "0"},
                            node_ip="127.0.0.1")
        actor.setup(dict, (), {"seen": 1})
        assert actor.execute(lambda executable: executable["seen"]) == 1
        assert actor.node()[0] == "127.0.0.1"

        def joins_then_fails() -> None:
            api.init()
            assert api.size() == 1
            raise KeyError("boom")

        with pytest.raises(KeyError, match="boom"):
            actor.run(joins_then_fails, (), {})
        assert not api.is_initialized(), "a worker whose function raised must have left the world"

        def joins() -> float:
            api.init()
            return float(api.allreduce(np.ones(2), op="sum")[0])

        assert actor.run_elastic(joins, (), {}) == (0, 1, 1.0)
        actor.leave()
        assert not api.is_initialized()
    finally:
        api.shutdown()
        thread.run(coordinator.stop(), 30)
        thread.stop()


def test_without_ray_taking_the_executor_names_the_extra() -> None:
    code = ("import sys; sys.modules['ray'] = None\n"
            "try:\n    from ringserve.ray import RayExecutor\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ringserve.ray needs Ray: install it with `pip install 'ringserve[ray]'`" in out.stdout, out
