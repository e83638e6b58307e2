"""The chaos campaign's short run (benchmarks/chaos.py --quick): ten faults (kills, pair kills,
hung workers, lane resets) against two live jobs, one on shared memory and one on the payload
lane, with 0 hangs, 0 untyped errors, 0 divergent replicas, 0 lost commits and every fault
recovered. The full campaign (300 faults over every job) is one command, documented in
docs/ops/chaos.md; this is the part of it that the default suite runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import chaos

pytestmark = pytest.mark.timeout(240)


def test_ten_faults_of_the_campaign_leave_no_hang_untyped_error_divergence_or_lost_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = chaos.main(["--faults", "10", "--seed", "40", "--quick", "--per-job", "5", "--workdir", str(tmp_path / "work"),
                       "--json", str(tmp_path / "campaign.json")])
    out = capsys.readouterr().out
    print(out)
    totals = dict(part.split("=") for part in out.strip().splitlines()[-1].split(" ") if "=" in part)
    assert code == 0, out
    assert int(totals["faults"]) == 10, out
    for bad in ("hangs", "untyped", "divergent", "lost_commits", "unrecovered", "unfinished_jobs"):
        assert totals[bad] == "0", out


def test_torchs_backend_error_is_typed_only_when_it_carries_a_typed_ringserve_error() -> None:
    tb = "Traceback (most recent call last):\n  File \"ddp_worker.py\", line 71, in main\n"
    typed = tb + ("[rank1]: torch.distributed.DistBackendError: ringserve: all_gather failed: RingChangedError: "
                  "The ring changed from view 1 to view 2: a peer died or left, and a torch group's members are fixed\n")
    assert chaos.untyped_errors(typed) == []
    for last in ("[rank1]: torch.distributed.DistBackendError: ringserve: all_gather failed: KeyError: 3",
                 "[rank1]: torch.distributed.DistBackendError: Connection closed by peer",
                 "asyncio.exceptions.CancelledError", "[rank0]: RuntimeError: ringserve: RingChangedError: x"):
        assert chaos.untyped_errors(tb + last + "\n") == [last]


def test_a_victim_still_waiting_to_join_when_training_ends_does_not_hold_the_campaign_to_its_timeout() -> None:
    """Seed 29's partition job: the victim (the launcher of that job) was held out of admission
    while the others trained to the last step; waiting for the whole world held the campaign until
    the victim's own elastic timeout failed it (exit 1), before ``finish`` could give it its grace."""
    import subprocess
    import time
    from types import SimpleNamespace

    def rec(pid: int, view: int, step: int) -> dict[str, object]:
        return {"pid": pid, "view": view, "step": step, "time": time.time()}

    victim = subprocess.Popen(["sleep", "30"])  # waits to join: alive throughout
    try:
        records = [rec(p, 18, s) for p in (1, 2, 3) for s in (498, 499)]
        live = SimpleNamespace(run=SimpleNamespace(records=lambda: records, launcher=victim))
        started = time.monotonic()
        assert not chaos.await_whole(live, 4, 1.0, 500)  # training not over: the whole timeout
        assert time.monotonic() - started >= 1.0
        records += [rec(p, 18, 500) for p in (1, 2, 3)]
        started = time.monotonic()
        assert not chaos.await_whole(live, 4, 20.0, 500)  # training over: at once
        assert time.monotonic() - started < 1.0
        records += [rec(4, 19, 1)]  # hypothetically whole again: True comes first
        records += [rec(p, 19, 1) for p in (1, 2, 3)]
        assert chaos.await_whole(live, 4, 20.0, 500)
    finally:
        victim.kill()
        victim.wait()


def test_of_a_chain_of_tracebacks_only_the_exception_raised_last_counts() -> None:
    cause = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in f\n"
             "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer\n")
    typed = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"hsdp.py\", line 253, in wrapper\n"
             "[rank0]: ringserve.errors.ReplicaGroupLostError: Replica group 'g1' lost a rank\n")
    for link in ("The above exception was the direct cause of the following exception:",
                 "During handling of the above exception, another exception occurred:"):
        assert chaos.untyped_errors(f"{cause}\n[rank0]: {link}\n\n{typed}") == []
        # the other way round, the untyped error is the one raised: it counts
        assert chaos.untyped_errors(f"{typed}\n[rank0]: {link}\n\n{cause}") == [cause.splitlines()[-1]]
    assert chaos.untyped_errors(cause) == [cause.splitlines()[-1]]  # alone, it counts
