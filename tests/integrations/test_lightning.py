"""A Lightning Trainer with ``DDPStrategy(process_group_backend="ringserve")`` on CPU trains to the
parameters that the same Trainer gets on gloo, under ``ringserve run`` and under Lightning's own
launcher (the script run alone with ``devices=2``: Lightning starts the second rank itself).

gloo runs once, under Lightning's launcher. At world 2 a gradient is the sum of two values, the
same in either order, so the backends agree to the bit; the tolerance leaves room for a reduction
that rounds once more (a division where gloo's multiplies), no more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import JOBS, PYTHON, compare, launch, ringserve_run

pytestmark = pytest.mark.integrations
ATOL = 1e-6


def _lightning_launch(out: Path, backend: str) -> list[str]:
    return [PYTHON, str(JOBS / "lightning_job.py"), str(out), backend, "2"]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lightning_gloo")
    log = launch(_lightning_launch(out, "gloo"), out, timeout_s=240)
    assert "trained 6 steps on 2 ranks over gloo" in log, log[-3000:]
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", ["ringserve-run", "lightning"])
def test_a_lightning_trainer_on_ringserve_trains_to_the_parameters_it_gets_on_gloo(
        gloo: Path, tmp_path: Path, launcher: str) -> None:
    command = (ringserve_run(2, "lightning_job.py", str(tmp_path), "ringserve", "2") if launcher == "ringserve-run"
               else _lightning_launch(tmp_path, "ringserve"))
    log = launch(command, tmp_path, timeout_s=240)
    assert "trained 6 steps on 2 ranks over ringserve" in log, log[-3000:]
    assert compare(tmp_path, gloo) <= ATOL
