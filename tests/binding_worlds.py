"""Worlds for the Keras and TensorFlow bindings' tests: real processes, a real coordinator.

``run_script(script, n, out_dir, backend=...)`` runs ``n`` processes of a script under
``ringserve run -np n`` (the launcher users run), with KERAS_BACKEND set, under a deadline, and
returns their combined output. Scripts write what the tests check under ``out_dir``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Short collective deadlines: a broken world fails the test in seconds, not minutes.
ENV = {
    "RINGSERVE_COLLECTIVE_TIMEOUT_S": "60",
    "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "90",
    "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "PYTHONUNBUFFERED": "1",
}


def run_script(script: Path, n: int, out_dir: Path, args: Sequence[str] = (), *, backend: str = "torch",
               timeout_s: float = 150.0, pass_out_dir: bool = True) -> str:
    """Runs ``ringserve run -np n python script out_dir *args`` (without out_dir when not
    ``pass_out_dir``) in out_dir; returns its output.

    Raises:
        AssertionError: the run failed or passed ``timeout_s``; its output is in the message.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV, "KERAS_BACKEND": backend,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "ringserve.cli", "run", "-np", str(n), sys.executable, str(script),
           *([str(out_dir)] if pass_out_dir else []), *args]
    # A session of its own: on a timeout the launcher and every worker it started are killed together.
    proc = subprocess.Popen(cmd, env=env, cwd=out_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"ringserve run -np {n} {script.name} ran past {timeout_s:g} s:\n{output[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"ringserve run -np {n} {script.name} exited {proc.returncode}:\n{output[-6000:]}"
    return output
