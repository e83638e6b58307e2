"""An elastic RayExecutor on a real local Ray cluster: an actor killed mid-run, the others go on at
their next commit, and a replacement placed later joins them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import ray_digits

from ringserve.ray import RayExecutor

pytestmark = pytest.mark.ray


EPOCHS, SEED, STEP_DELAY_S = 10, 0, 0.08


@pytest.mark.timeout(500)
def test_a_killed_actor_is_replaced_and_every_worker_finishes_with_the_same_parameters(ray_cluster: Any) -> None:
    import ray

    # A heartbeat timeout with room for a descheduled process: the killed actor's worker is found at
    # once all the same, by its peers' broken streams and the coordinator's probe.
    settings = RayExecutor.create_settings(timeout_s=120, coordinator={"heartbeat_timeout_s": 15.0})
    ex = RayExecutor(settings, num_workers=3, min_workers=2, max_workers=3, cooldown_range=(0.5, 1.0),
                     reset_limit=2, elastic_timeout=120)
    ex.start()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["results"] = ex.run(ray_digits.train_elastic, args=[EPOCHS, SEED, STEP_DELAY_S])
        except BaseException as exc:
            box["error"] = exc

    runner = threading.Thread(target=run, name="elastic-run")
    runner.start()
    try:
        deadline = time.monotonic() + 240
        while ex.status().mark_step < 20:  # some commits made by the world of 3
            assert runner.is_alive(), box
            assert time.monotonic() < deadline, "the world of 3 made no 20 commits in time"
            time.sleep(0.2)
        victim = ex.workers[1]
        ray.kill(victim, no_restart=True)
        killed_at = ex.status().mark_step
        runner.join(400)
        assert not runner.is_alive(), "the elastic run did not finish"
        assert "error" not in box, box.get("error")
        results = box["results"]
        history = [(e.kind, e.text) for e in ex.status().history]
    finally:
        ex.shutdown()
        runner.join(30)
    failed = [i for i, (kind, _) in enumerate(history) if kind == "failed"]
    assert failed, f"the killed actor's worker was never removed: {history}"
    joined_after = [text for kind, text in history[failed[0]:] if kind == "joined"]
    assert joined_after, f"no replacement joined after the kill: {history}"
    # The survivors and the replacement all reached the last epoch with the same parameters.
    assert len(results) == 3, results
    assert all(r["epoch"] == EPOCHS and r["identical"] for r in results), results
    assert len({r["digest"] for r in results}) == 1
    assert any(2 in r["sizes"] for r in results), "the survivors never trained as a world of 2"
    assert killed_at < results[0]["steps"]
    assert any("did not answer a probe" in text for kind, text in history if kind == "failed"), history
