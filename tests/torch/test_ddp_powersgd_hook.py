"""torch's own DDP powerSGD_hook over init_process_group("ringserve"), with DDP's default buckets.

Over gloo on the emulated WAN it stalls (benchmarks/wan.py): the hook waits, inside a ``.then()``
callback, for an all_reduce it starts there; DDP's first two buckets finish their first all_reduce
at about the same time, both of gloo's two worker threads block in the callback, and the all_reduces
they wait for have no thread left to run on. ringserve's backend completes futures on a pool of up
to 32 threads (ringserve/torch/distributed/work.py), so a blocked callback never holds the
completion of the op it waits for. And the ops a callback starts are named after the op whose
callbacks they are (work.py, plane.py), so ranks whose callbacks run in another order still pair
them: numbered in the order the threads started them, they failed with MismatchError. (Over gloo
on loopback the same run fails too, with its connections reset, the same race.) Checked here both
ways: the completions themselves, with two callbacks blocked at once; and a real world training
with the hook and DDP's default buckets.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _dist_worlds import DIST_WORKERS, run_dist
from test_dist_units import _completing

from ringserve.torch.distributed import work
from ringserve.torch.distributed.plane import Plane
from ringserve.torch.distributed.work import Completer

N = 2

pytestmark = pytest.mark.timeout(180)


def test_two_callbacks_blocked_at_once_on_ops_they_started_still_complete() -> None:
    completer = Completer(10.0)
    both_blocked = threading.Barrier(2, timeout=5)

    def nested(value: float) -> Any:
        def run(_: Any) -> torch.Tensor:
            # As PowerSGD's hook: start an op inside the callback, and wait for it there; the op
            # completes only once both callbacks are blocked, as they are on the WAN.
            inner = completer.track("all_reduce", [_completing(value, delay_s=0.05)], lambda r: [torch.tensor(r[0])])
            both_blocked.wait()
            return inner.get_future().wait()[0]
        return run

    # Finishing once both callbacks are registered (a callback registered on a finished future runs at once, here).
    first = completer.track("all_reduce", [_completing(1, delay_s=0.3)], lambda r: [torch.tensor(1.0)])
    second = completer.track("all_reduce", [_completing(2, delay_s=0.3)], lambda r: [torch.tensor(2.0)])
    chained = [first.get_future().then(nested(10.0)), second.get_future().then(nested(20.0))]
    assert [c.wait().item() for c in chained] == [10.0, 20.0]
    completer.close()


def test_ddps_powersgd_hook_with_its_default_buckets_trains_over_ringserve_alike_on_every_rank(tmp_path: Path) -> None:
    run_dist(DIST_WORKERS / "ddp_powersgd.py", N, tmp_path, ["ringserve"], timeout_s=150)
    ours = sorted((torch.load(tmp_path / f"rank{r}.pt") for r in range(N)), key=lambda r: r["rank"])
    assert len(ours[0]["buckets"]) >= 2, ours[0]["buckets"]  # DDP's default buckets: more than one
    assert ours[0]["losses"][-1] < ours[0]["losses"][0]
    for other in ours[1:]:
        for key, value in ours[0]["params"].items():
            assert torch.equal(value, other["params"][key]), f"{key} differs between rank 0 and rank {other['rank']}"


def test_a_plane_with_its_own_timeout_labels_its_ops_in_its_parents_sequence_and_callbacks_after_their_op() -> None:
    # The naming alone (no op starts): what ranks must agree on, whatever thread starts an op.
    context = SimpleNamespace(config=SimpleNamespace(collective_timeout_s=30.0), worker=SimpleNamespace(rank=0, size=2))
    plane = Plane(context, tag="g", view_id=1)  # type: ignore[arg-type]
    other = plane.with_timeout(5.0)
    assert other is not plane and other.timeout_s == 5.0
    assert [plane._issue(), other._issue(), plane._issue()] == [("g", "1"), ("g", "2"), ("g", "3")]
    work._local.scope = work.CallbackScope("2")
    try:
        assert [plane._issue(), other._issue()] == [("g.then.2.1", "2.1"), ("g.then.2.2", "2.2")]
    finally:
        work._local.scope = None
    assert plane._issue() == ("g", "4")


def test_an_op_made_through_torch_distributeds_python_functions_is_told_from_one_made_by_ddps_reducer() -> None:
    # Its future is returned once it has its outcome, so that then-callbacks run in program order
    # (work.get_future); DDP's reducer, calling from C++, has no Python caller of c10d's.
    assert not work.from_python_api()
    c10d: dict[str, Any] = {"__name__": "torch.distributed.distributed_c10d", "made": work.from_python_api}
    exec("def all_reduce():\n    return made()\n", c10d)
    assert c10d["all_reduce"]()


def test_the_python_call_signal_holds_on_this_torch_c10ds_calls_are_python_ddps_reducer_calls_are_not(tmp_path: Path) -> None:
    # work.from_python_api reads the caller's module from the stack, as torch gives no supported
    # signal: this fails the day torch's c10d calls the backend from elsewhere, or DDP's reducer
    # from Python.
    run_dist(DIST_WORKERS / "program_order.py", N, tmp_path, [], timeout_s=120)
    for rank in range(N):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["python"] and all(seen["python"]), seen
        assert seen["reducer"] and not any(seen["reducer"]), seen
