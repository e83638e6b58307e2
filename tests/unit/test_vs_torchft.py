"""The figures of benchmarks/vs_torchft.py, read from made-up step records: no torchft, no process.

A record is what a benchmark worker writes after each committed step: ``t`` (wall clock), ``step``
(the committed step count), ``n`` (replicas in that step), ``dt`` (its seconds) and ``sync``.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from vs_torchft import RunFailed, Target, join_stall, paired, recovery, spread, steady_rate, sync_step


def rec(t: float, step: int, n: int = 3, dt: float = 0.04, sync: bool = False) -> dict[str, float]:
    return {"t": t, "step": step, "n": n, "dt": dt, "sync": sync}


def every(start: float, first_step: int, count: int, period: float = 0.1, n: int = 3) -> list[dict[str, float]]:
    return [rec(start + i * period, first_step + i, n) for i in range(count)]


def test_the_steady_rate_counts_the_steps_between_the_first_and_last_inside_the_window() -> None:
    records = every(0.0, 1, 50, period=0.04)  # 25 steps a second
    assert steady_rate(records, 0.5, 1.5) == pytest.approx(25.0)


def test_a_window_with_fewer_than_two_steps_is_a_failed_run_not_a_zero() -> None:
    with pytest.raises(RunFailed):
        steady_rate(every(0.0, 1, 3), 10.0, 11.0)


def test_recovery_is_the_slowest_survivors_first_step_in_the_smaller_world_after_the_kill() -> None:
    a = every(0.0, 1, 10) + every(2.0, 11, 5, n=2)
    b = every(0.0, 1, 10) + every(2.5, 11, 5, n=2)
    seconds, rolled = recovery([a, b], killed_at=0.95)
    assert seconds == pytest.approx(2.5 - 0.95)
    assert rolled == 0


def test_a_step_still_completed_with_the_dead_peer_does_not_end_the_recovery() -> None:
    # Step 11 finished with all three after the kill (its allreduce was through); the world of two
    # only committed at 3.0.
    a = [*every(0.0, 1, 10), rec(1.0, 11), *every(3.0, 12, 3, n=2)]
    seconds, rolled = recovery([a], killed_at=0.95)
    assert seconds == pytest.approx(3.0 - 0.95)
    assert rolled == 0


def test_steps_committed_again_after_the_kill_count_as_rolled_back() -> None:
    a = every(0.0, 1, 10) + every(2.0, 8, 5, n=2)  # went back from 10 to 7, then committed 8
    assert recovery([a], killed_at=0.95)[1] == 3


def test_a_survivor_that_never_steps_without_the_dead_worker_is_a_failed_run() -> None:
    with pytest.raises(RunFailed):
        recovery([every(0.0, 1, 10)], killed_at=0.5)


def test_the_join_stall_is_the_longest_gap_from_the_restart_to_a_second_after_the_joiners_first_step() -> None:
    survivor = [*every(0.0, 1, 10, n=2), rec(2.3, 11), *every(2.4, 12, 30)]  # 1.4 s gap, 0.9 to 2.3
    joiner = every(2.3, 11, 30)
    assert join_stall([survivor], restarted_at=0.5, joiner=joiner) == pytest.approx(1.4)
    # A gap long after the join is not the join's.
    late = [*survivor, rec(20.0, 100)]
    assert join_stall([late], restarted_at=0.5, joiner=joiner) == pytest.approx(1.4)


def test_a_joiner_that_never_steps_is_a_failed_run() -> None:
    with pytest.raises(RunFailed):
        join_stall([every(0.0, 1, 10)], restarted_at=0.5, joiner=[])


def test_the_sync_step_leaves_out_each_workers_first_sync() -> None:
    worker = [rec(i, i, dt=0.01, sync=False) for i in range(1, 20)] + [rec(20, 20, dt=5.0, sync=True)]
    worker += [rec(i, i, dt=0.01, sync=False) for i in range(21, 40)] + [rec(40, 40, dt=0.08, sync=True)]
    worker += [{**rec(60, 60, dt=0.06, sync=True), "commit": 0.01}]
    synced, commit, inner = sync_step([worker, worker])
    assert synced == pytest.approx(0.07)
    assert commit == pytest.approx(0.005)
    assert inner == pytest.approx(0.01)


def test_ratios_pair_the_rounds_and_skip_a_round_where_either_side_failed() -> None:
    assert paired([1.0, None, 3.0], [2.0, 2.0, None]) == [0.5]
    assert spread([]) == "-"
    assert spread([2.0]) == "2.00"
    assert spread([3.0, 1.0, 2.0]) == "2.00 [1.00-3.00]"


@pytest.mark.parametrize(("op", "bound", "ratios", "passes"), [
    ("<=", 0.2, [0.03, 0.05, 0.9], True),     # the median, not the worst round
    ("<=", 0.2, [0.3, 0.25, 0.1], False),
    (">=", 1.3, [1.31, 1.4, 1.0], True),
    (">=", 1.3, [1.29], False),
])
def test_a_target_is_checked_on_the_median_paired_ratio(op: str, bound: float, ratios: list[float], passes: bool) -> None:
    verdict = Target("x", "torchft", op, bound).verdict(ratios)
    assert verdict.startswith("PASS" if passes else "FAIL"), verdict


def test_a_target_with_no_measurement_fails() -> None:
    assert Target("x", "torchft", "<=", 0.2).verdict([]).startswith("FAIL")
