"""A replica group agrees on every outcome (ringserve.torch.hsdp.ReplicaGroup.agreed), forced on a
real gloo group of two processes on loopback (workers/hsdp_agreed.py): a step that fails on one
rank fails on both, the worse outcome wins, and a rank that died leaves its partner with
ReplicaGroupLostError.

test_hsdp.py runs whole HSDP jobs, where a failure on one rank of a group alone is a matter of
timing; here each case makes one rank's step fail and the other's pass.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("workers") / "hsdp_agreed.py"


def test_every_rank_of_a_group_ends_a_step_alike_and_the_worse_outcome_wins() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    got = {}
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"
        got[rank] = dict(json.loads(line) for line in out.splitlines() if line.startswith("["))
    assert got[0]["both-pass"] == got[1]["both-pass"] == "done"
    # Failed on rank 1 only: rank 0 passed, and restores with it.
    assert (got[0]["one-fails"], got[1]["one-fails"]) == ("GroupMemberFailedError", "RingChangedError")
    # A damaged frame on rank 0 only: rank 1 retries in the same view with it.
    assert (got[0]["one-corrupt"], got[1]["one-corrupt"]) == ("CorruptFrameError", "CorruptFrameError")
    # A failure outranks a damaged frame: both restore and wait for the next view.
    assert (got[0]["fails-and-corrupt"], got[1]["fails-and-corrupt"]) == ("GroupMemberFailedError", "RingChangedError")
    # Its partner died: the group's own backend fails under rank 0, named.
    assert got[0]["partner-dies"] == "ReplicaGroupLostError"
    # Through a functional collective (a DTensor's full_tensor()), the backend's error all the same;
    # a RuntimeError of the script's own raised inside a torch call is not.
    assert got[0]["partner-dies-dtensor"] == "backend"
    assert got[0]["own-error"] == "not the backend's"
    assert "partner-dies" not in got[1]
