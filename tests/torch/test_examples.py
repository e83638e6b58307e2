"""The digits example trains on 4 workers under the launcher and ends with identical parameters."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from ringserve.launch import launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def train_digits(*args: str) -> tuple[float, str]:
    """Runs the example on 4 workers; returns its test accuracy in percent, and its output."""
    out = io.BytesIO()
    outcome = launch(4, [sys.executable, str(EXAMPLE), "--epochs", "6", *args], out=out)
    log = out.getvalue().decode(errors="replace")
    assert outcome.code == 0, log[-4000:]
    assert "[0] all 4 ranks hold identical parameters" in log, log[-4000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)%", log).group(1))  # type: ignore[union-attr]
    return accuracy, log


@pytest.mark.timeout(150)
def test_the_digits_example_learns_on_four_workers_and_ends_with_identical_parameters() -> None:
    accuracy, log = train_digits()
    assert accuracy > 85.0, log[-4000:]
    assert "digits on 4 workers" in log  # rank 0's progress bar


INT8_MARGIN = 1.5  # percentage points of test accuracy


@pytest.mark.timeout(300)
def test_int8_gradients_with_error_feedback_reach_the_accuracy_of_uncompressed_training() -> None:
    uncompressed, _ = train_digits()
    int8, log = train_digits("--compression", "int8")
    assert int8 >= uncompressed - INT8_MARGIN, (int8, uncompressed, log[-2000:])
