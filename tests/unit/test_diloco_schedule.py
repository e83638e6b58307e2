"""DiLoCo's pure pieces: the fragment schedule (torchft's), the split into fragments, the outer
step and the blend."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.diloco import Schedule, _checked_groups, blend, outer_step, split
from ringserve.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)


def timeline(schedule: Schedule, steps: int) -> list[tuple[int, str, int]]:
    events = []
    for step in range(1, steps + 1):
        events += [(step, "start", f) for f in schedule.starts(step)]
        events += [(step, "land", f) for f in schedule.lands(step)]
    return events


def test_one_fragment_syncs_every_h_steps_and_lands_at_once_without_delay() -> None:
    assert timeline(Schedule(4), 12) == [(4, "start", 0), (4, "land", 0), (8, "start", 0), (8, "land", 0),
                                         (12, "start", 0), (12, "land", 0)]


@pytest.mark.parametrize(("h", "f", "delay"), [(6, 3, 0), (6, 3, 1), (8, 2, 3), (12, 4, 2), (5, 5, 0)])
def test_each_fragment_starts_every_h_steps_in_turn_and_lands_delay_steps_later_before_the_next_starts(
    h: int, f: int, delay: int,
) -> None:
    schedule = Schedule(h, f, delay)
    events = timeline(schedule, 5 * h)
    for frag in range(f):
        starts = [s for s, kind, x in events if kind == "start" and x == frag]
        lands = [s for s, kind, x in events if kind == "land" and x == frag]
        assert starts == list(range(h // f * (frag + 1), 5 * h + 1, h))
        assert lands == [s + delay for s in starts if s + delay <= 5 * h]
    # One fragment starts every h / f steps, and at most one sync is in flight between steps.
    assert [s for s, kind, _ in events if kind == "start"] == list(range(h // f, 5 * h + 1, h // f))
    in_flight = 0
    for _, kind, _ in events:
        in_flight += 1 if kind == "start" else -1
        assert 0 <= in_flight <= 1


@pytest.mark.parametrize(("knobs", "message"), [
    (dict(sync_every=0), r"sync_every \(0\) must be at least 1"),
    (dict(sync_every=10, fragments=3), r"sync_every \(10\) must be a multiple of fragments \(3\)"),
    (dict(sync_every=10, fragments=2, fragment_sync_delay=5), r"fragment_sync_delay \(5\) must be at least 0 and below"),
    (dict(sync_every=10, fragments=0), r"fragments \(0\) must be at least 1"),
])
def test_a_bad_schedule_fails_naming_the_value(knobs: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Schedule(**knobs)


def test_fragments_split_consecutive_parameters_into_groups_of_about_equal_size() -> None:
    assert split([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split([1, 1, 1, 100], 3) == [[0, 1], [2], [3]]  # every group gets a parameter
    assert split([1, 1, 1], 3) == [[0], [1], [2]]
    assert split([5], 1) == [[0]]
    # The MLP of the benchmarks: a parameter is never split, so the nearest cut is after the first layer.
    assert split([784 * 2048, 2048, 2048 * 2048, 2048, 2048 * 10, 10], 2) == [[0, 1], [2, 3, 4, 5]]
    with pytest.raises(InvalidArgumentError, match=r"fragments \(3\) cannot exceed the number of parameters \(2\)"):
        split([1, 2], 3)


def test_the_outer_step_is_torchs_sgd_with_nesterov_momentum() -> None:
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(100).astype(np.float32)
    buf = np.zeros(100, np.float32)
    ref_theta, ref_buf = theta.astype(np.float64), np.zeros(100)
    for _ in range(3):
        g = rng.standard_normal(100).astype(np.float32)
        outer_step(theta, g, buf, lr=0.7, momentum=0.9, nesterov=True)
        ref_buf = 0.9 * ref_buf + g
        ref_theta -= 0.7 * (g + 0.9 * ref_buf)
    np.testing.assert_allclose(theta, ref_theta, rtol=1e-5, atol=1e-5)
    plain = np.ones(4, np.float32)
    outer_step(plain, np.full(4, 0.25, np.float32), None, lr=1.0, momentum=0.0, nesterov=False)
    np.testing.assert_array_equal(plain, np.full(4, 0.75, np.float32))


def test_the_blend_keeps_alpha_of_the_local_copy_and_alpha_zero_is_the_global_copy_itself() -> None:
    local, glob = np.full(3, 2.0, np.float32), np.full(3, 4.0, np.float32)
    assert blend(local, glob, 0.0) is glob
    np.testing.assert_array_equal(blend(local, glob, 0.25), np.full(3, 3.5, np.float32))


def test_explicit_fragments_must_hold_every_parameter_once() -> None:
    assert _checked_groups([[2, 3], [0, 1]], 4) == [[2, 3], [0, 1]]
    for bad in ([[0, 1], [1, 2, 3]], [[0, 1]], [[0, 1, 2, 3], []], [[0, 1, 2, 3, 4]]):
        with pytest.raises(InvalidArgumentError, match="each of the 4 parameters exactly once"):
            _checked_groups(bad, 4)
