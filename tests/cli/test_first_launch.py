"""A new user's first launch (issue 43): `.venv/bin/ringserve run -np 4 python train.py` without the
venv activated starts the system's python, which has none of the job's packages.

- The launcher checks, once and before any worker starts, that a python other than its own can
  import ringserve and its core, and names both interpreters when it cannot.
- With --restart-failed, workers that die the same way before any of them joined the job end the
  run after a few, instead of being restarted until every restart is spent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringserve.launch.elastic import SAME_EARLY_DEATHS

RINGSERVE = [sys.executable, "-m", "ringserve.cli"]
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGSERVE_", "PYTHON"))}
    return {**env, **extra}


def system_python_lacks_grpc() -> bool:
    if SYSTEM_PYTHON is None:
        return False
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import grpc"], capture_output=True, env=clean_env(), check=False)
    return probe.returncode != 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(not system_python_lacks_grpc(), reason="needs a system python3 without the job's packages")
def test_a_python_that_cannot_import_ringserve_is_named_before_any_worker_starts(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    assert SYSTEM_PYTHON is not None
    (bin_dir / "python").symlink_to(SYSTEM_PYTHON)
    # From the repository's root, as a user runs it: the source tree is importable there, its packages are not.
    result = subprocess.run([*RINGSERVE, "run", "-np", "4", "python", "train.py"], capture_output=True, text=True,
                            timeout=50, cwd=Path(__file__).resolve().parents[2],
                            env=clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"The command's python ({bin_dir / 'python'}) cannot import ringserve" in result.stderr
    assert "No module named" in result.stderr
    assert sys.executable in result.stderr  # the interpreter to use instead
    assert "starting 4 workers" not in result.stdout


@pytest.mark.timeout(90)
def test_the_launchers_own_python_and_a_python_that_can_import_ringserve_start_as_before() -> None:
    script = "import ringserve as rs\nrs.init()\nprint('rank', rs.rank(), 'of', rs.size())\nrs.shutdown()\n"
    result = subprocess.run([*RINGSERVE, "run", "-np", "2", sys.executable, "-c", script], capture_output=True,
                            text=True, timeout=80, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" of 2") == 2


@pytest.mark.timeout(90)
def test_workers_dying_the_same_way_before_any_joined_end_the_run_after_a_few_not_every_restart() -> None:
    script = "import sys\nprint(\"ModuleNotFoundError: No module named 'torch'\", file=sys.stderr)\nsys.exit(1)\n"
    result = subprocess.run([*RINGSERVE, "run", "-np", "4", "--restart-failed", "--max-restarts", "100",
                             sys.executable, "-c", script], capture_output=True, text=True, timeout=80, env=clean_env())
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"{SAME_EARLY_DEATHS} workers in a row exited with code 1 before any joined the job: " \
           f"ModuleNotFoundError: No module named 'torch'" in out
    assert out.count("starting it again") < SAME_EARLY_DEATHS, out


@pytest.mark.timeout(120)
def test_a_worker_that_dies_after_the_job_formed_is_still_restarted(tmp_path: Path) -> None:
    # Rank 0's first process dies after joining; started again, it finishes with the others.
    marker = tmp_path / "died-once"
    script = (
        "import os, sys, numpy as np, ringserve as rs\n"
        "rs.init()\n"
        f"if rs.rank() == 0 and not os.path.exists({str(marker)!r}):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    os._exit(1)\n"
        "rs.shutdown()\n"
    )
    result = subprocess.run([*RINGSERVE, "run", "-np", "2", "--restart-failed", sys.executable, "-c", script],
                            capture_output=True, text=True, timeout=110, env=clean_env())
    out = result.stdout + result.stderr
    assert "starting it again" in out, out
    assert "before any joined" not in out, out
