"""Fault-tolerant HSDP (ringserve.torch.hsdp): replica groups of two ranks, each sharding the model
with FSDP2 over gloo, replicated across the groups by ringserve, with groups killed mid-run.

Real processes on loopback: one coordinator, and each group's two ranks started as a torchrun
of the group would start them (workers/hsdp_worker.py). Every group trains on the same batches,
so a run that loses groups and takes them back must end exactly where one process training on a
group's batches ends, and every group with the same parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).with_name("workers")
sys.path.insert(0, str(WORKERS))
import hsdp_worker  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STEPS = 160
PAUSE_S = 0.01


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """A coordinator, and replica groups started (and killed) by the test."""

    def __init__(self, out: Path, min_workers: int) -> None:
        self.out = out
        # Its stdout (the line saying where it listens) is a pipe; its log, read by nobody while it
        # runs, goes to a file (in tails()): in a pipe, a coordinator logging the faults could block.
        log = out / "coordinator.log"
        with log.open("w") as sink:
            self.coordinator = subprocess.Popen(
                [sys.executable, "-m", "ringserve.cli", "coordinator", "--port", "0", "--min-workers", str(min_workers),
                 "--heartbeat-timeout", "2"], stdout=subprocess.PIPE, stderr=sink, text=True)
        assert self.coordinator.stdout is not None
        line = self.coordinator.stdout.readline()
        assert "listening on" in line, line + log.read_text()[-3000:]
        self.address = line.split("listening on ", 1)[1].split()[0]
        self.procs: dict[str, list[subprocess.Popen[bytes]]] = {}

    def group(self, name: str, start: int) -> list[subprocess.Popen[bytes]]:
        """Starts the two ranks of group ``name`` (its ``start``-th start) on a fresh gloo port."""
        port = _free_port()
        procs = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "RINGSERVE_HSDP_GROUP": name, "RINGSERVE_COORDINATOR": self.address,
                   "RINGSERVE_ELASTIC_TIMEOUT_S": "60", "PYTHONUNBUFFERED": "1"}
            with (self.out / f"{name}{start}-{rank}.log").open("wb") as sink:
                procs.append(subprocess.Popen([sys.executable, str(WORKERS / "hsdp_worker.py"), str(self.out), str(STEPS),
                                               str(PAUSE_S)], env=env, stdout=sink, stderr=subprocess.STDOUT))
        self.procs[f"{name}{start}"] = procs
        return procs

    def records(self) -> list[dict]:
        return [json.loads(line) for f in sorted(self.out.glob("*.jsonl")) for line in f.read_text().splitlines()]

    def wait_for(self, what: str, check: Callable[[list[dict]], bool], timeout_s: float = 90.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = self.records()
            if check(records):
                return records
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout_s} s; logs: {self.tails()}")

    def tails(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(self.out.glob("*.log")))

    def close(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.coordinator.kill()
        self.coordinator.wait()


def _last_step(records: list[dict], group: str) -> int:
    return max((r["step"] for r in records if r["group"] == group), default=0)


def _check_final(out: Path, expected_groups: int) -> None:
    finals = [torch.load(f) for f in sorted(out.glob("final-*.pt"))]
    assert len(finals) == expected_groups, sorted(p.name for p in out.iterdir())
    expected = hsdp_worker.reference(STEPS, 2)
    for key, value in expected.items():
        for final in finals:
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            assert torch.equal(final[key], finals[0][key]), f"{key}: the groups' parameters differ"


def test_a_killed_group_leaves_the_others_training_and_comes_back_with_its_shards(tmp_path: Path) -> None:
    """Group B is killed whole (both ranks, SIGKILL) at step 10; group A trains on alone, then a
    new start of B takes each shard from its counterpart in A. Then one rank of A is killed: its
    partner ends with ReplicaGroupLostError (the group cannot go on without it), B trains on
    alone, and a new start of A comes back. Both groups end on the no-kill parameters."""
    job = Job(tmp_path, min_workers=2)
    try:
        job.group("A", 0)
        b = job.group("B", 0)
        job.wait_for("step 10 of group B", lambda rs: _last_step(rs, "B") >= 10)
        (tmp_path / "hold").touch()  # the survivors go on slowly, until the new start of B is in
        for p in b:
            p.send_signal(signal.SIGKILL)
        killed_at = time.time()
        # A goes on alone: commits in a view of its two ranks only.
        alone = job.wait_for("group A alone", lambda rs: any(r["group"] == "A" and r["size"] == 2 and r["time"] > killed_at
                                                            for r in rs))
        gap = min(r["time"] for r in alone if r["group"] == "A" and r["size"] == 2) - killed_at
        assert gap < 10, f"group A took {gap:.1f} s to go on without group B"
        job.group("B", 1)
        back = job.wait_for("B back", lambda rs: any(r["group"] == "B" and r["time"] > killed_at for r in rs))
        first_b = min(r["step"] for r in back if r["group"] == "B" and r["time"] > killed_at)
        assert first_b > 12, f"the new start of B began at step {first_b}, not at A's commit"
        assert first_b < STEPS - 20, "B came back too late to test anything"
        (tmp_path / "hold").unlink()
        # One rank of A dies: its partner must end, named, and B goes on alone.
        a1 = job.procs["A0"][1]
        (tmp_path / "hold").touch()
        a1.send_signal(signal.SIGKILL)
        lost_at = time.time()
        assert job.procs["A0"][0].wait(30) != 0
        partner = (tmp_path / "A0-0.log").read_text()
        assert "ReplicaGroupLostError" in partner and "Replica group 'A' lost a rank" in partner, partner[-3000:]
        job.wait_for("group B alone", lambda rs: any(r["group"] == "B" and r["size"] == 2 and r["time"] > lost_at
                                                     for r in rs))
        a_again = job.group("A", 1)
        job.wait_for("A back", lambda rs: any(r["group"] == "A" and r["time"] > lost_at for r in rs))
        (tmp_path / "hold").unlink()
        for p in [*a_again, *job.procs["B1"]]:
            assert p.wait(180) == 0, job.tails()
        records = job.records()
        assert _last_step(records, "A") == _last_step(records, "B") == STEPS
        finished = {r["gang"] for r in records if r["step"] == STEPS}
        assert len(finished) == 2, finished
        for gang in finished:  # both ranks of a group commit the same steps, in the same views
            by_rank = [{(r["view"], r["step"]) for r in records if r["gang"] == gang and r["rank"] == k} for k in range(2)]
            assert by_rank[0] == by_rank[1], f"{gang}: {sorted(by_rank[0] ^ by_rank[1])}"
        _check_final(tmp_path, expected_groups=2)
    finally:
        job.close()

