"""The digits example trains on 4 workers under the launcher and ends with identical parameters."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from ringserve.launch import launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


@pytest.mark.timeout(150)
def test_the_digits_example_learns_on_four_workers_and_ends_with_identical_parameters() -> None:
    out = io.BytesIO()

    outcome = launch(4, [sys.executable, str(EXAMPLE), "--epochs", "6"], out=out)

    log = out.getvalue().decode(errors="replace")
    assert outcome.code == 0, log[-4000:]
    assert "[0] all 4 ranks hold identical parameters" in log, log[-4000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)%", log).group(1))  # type: ignore[union-attr]
    assert accuracy > 85.0, log[-4000:]
    assert "digits on 4 workers" in log  # rank 0's progress bar
