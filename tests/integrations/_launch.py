"""Jobs of the training frameworks, started the ways users start them, and their results compared.

``launch(command, tmp_path)`` runs one launcher command (``ringserve run``, torchrun, ``accelerate
launch``, or the script itself where the framework starts its own ranks) in a session of its own,
with the repository on the path and short ringserve deadlines, and kills the whole session if it
runs past its deadline. A job writes ``{"init": ..., "final": ...}`` (rank 0's first and last
parameters) to ``OUT_DIR/params.pt``; ``compare`` says how far one job's final parameters are from
another's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).parent / "jobs"
BIN = Path(sys.executable).parent
PYTHON = sys.executable

# Variables a launcher sets for its ranks: none may leak into a job from the test's own environment.
_LAUNCH_VARS = ("RINGSERVE_COORDINATOR", "RINGSERVE_RANK_HINT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ringserve_run(n: int, script: str, *args: str) -> list[str]:
    """``ringserve run -np n python jobs/script args``."""
    return [PYTHON, "-m", "ringserve.cli", "run", "-np", str(n), PYTHON, str(JOBS / script), *args]


def launch(command: list[str], tmp_path: Path, *, timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Runs ``command`` to its end in ``tmp_path`` (with ``env`` added to the environment) and
    returns its output.

    Raises:
        AssertionError: it exited non-zero or ran past ``timeout_s``; its output is in the message.
    """
    full = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    full.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "RINGSERVE_COLLECTIVE_TIMEOUT_S": "60",
        "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # Hugging Face: nothing fetched, no config of the user's read, no telemetry.
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    })
    proc = subprocess.Popen(command, env=full, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{command} ran past {timeout_s:g} s:\n{out[-6000:]}") from None
    finally:
        # The ranks a launcher started, should it have left any behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{command} exited with code {proc.returncode}:\n{out[-6000:]}"
    return out


def load(out_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A job's first and final parameters; the final ones must have moved (the job trained)."""
    saved: dict[str, dict[str, torch.Tensor]] = torch.load(out_dir / "params.pt")
    assert any(not torch.equal(saved["init"][k], v) for k, v in saved["final"].items()), "no parameter moved"
    return saved


def compare(ours: Path, theirs: Path) -> float:
    """The largest absolute difference between two jobs' final parameters (same names, same shapes),
    after checking that both started from the same ones."""
    a, b = load(ours), load(theirs)
    assert a["final"].keys() == b["final"].keys(), (sorted(a["final"]), sorted(b["final"]))
    for k, v in a["init"].items():
        assert torch.equal(v, b["init"][k]), f"{k}: the two jobs started from different parameters"
    return max((a["final"][k] - b["final"][k]).abs().max().item() for k in a["final"])
