"""benchmarks/scale_sim.py's Growth: the CPU figures carried with N through two calibrations."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from scale_sim import Figures, Growth, calibrated_on

from ringserve.testing import netsim


def figures(call: float, frame: float, byte: float, fill: float, check: float) -> Figures:
    return Figures(netsim.Cpu(2, frame, byte, 2), call, fill, check, 30e-6, 1e10)


def values(f: Figures) -> tuple[float, ...]:
    return f.call_s, f.cpu.frame_s, f.cpu.byte_s, f.fill_s, f.check_s


def test_two_calibrations_are_met_exactly_at_their_own_n_and_carried_as_a_power_law_beyond() -> None:
    a, b = figures(4e-4, 2e-4, 2e-10, 1.8e-10, 3.4e-10), figures(1.6e-3, 2e-4, 4e-10, 3.6e-10, 3.4e-10)
    growth = Growth.of([(128, b), (16, a)])  # in either order
    assert growth.at_n == 16
    for n, want in ((16, a), (128, b)):
        assert values(growth.at(n)) == pytest.approx(values(want), rel=1e-12)
    # x4 over three doublings is 2^(2/3) a doubling; x2 is 2^(1/3); unchanged stays
    assert growth.exponents["call_s"] == pytest.approx(2 / 3)
    assert growth.exponents["byte_s"] == pytest.approx(1 / 3)
    assert growth.exponents["frame_s"] == pytest.approx(0.0) and growth.exponents["check_s"] == pytest.approx(0.0)
    at256 = growth.at(256)
    assert at256.call_s == pytest.approx(1.6e-3 * 2 ** (2 / 3))
    assert at256.cpu.byte_s == pytest.approx(4e-10 * 2 ** (1 / 3))
    assert at256.cpu.cores == 2 and at256.cpu.handoffs == 2 and at256.latency_s == 30e-6


def test_one_calibration_does_not_grow() -> None:
    a = figures(4e-4, 2e-4, 2e-10, 1.8e-10, 3.4e-10)
    growth = Growth.of([(16, a)])
    assert growth.exponents == {}
    assert values(growth.at(1024)) == values(a)


def test_two_calibrations_at_the_same_n_are_refused_by_name() -> None:
    a = figures(4e-4, 2e-4, 2e-10, 1.8e-10, 3.4e-10)
    with pytest.raises(SystemExit, match="same N"):
        Growth.of([(16, a), (16, a)])


def test_the_charts_words_name_the_calibration_runs() -> None:
    assert calibrated_on([16]) == "N=16"
    assert calibrated_on([128, 16]) == "N=16 and 128, grown with N"
