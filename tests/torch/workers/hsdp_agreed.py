"""One rank of a gloo group of two, for test_hsdp_agreed.py: each case's outcome of
``ReplicaGroup.agreed`` (or, for ``partner-dies``, of the group's next allreduce once rank 1 has
exited), one JSON line each on stdout.

    python hsdp_agreed.py RANK PORT
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ringserve.errors import CorruptFrameError, RingChangedError
from ringserve.torch import hsdp

CASES: dict[str, tuple[BaseException | None, BaseException | None]] = {  # what fails on rank 0, on rank 1
    "both-pass": (None, None),
    "one-fails": (None, RingChangedError(3, 4, "forced")),
    "one-corrupt": (CorruptFrameError("x#1", "forced"), None),
    "fails-and-corrupt": (CorruptFrameError("x#1", "forced"), RingChangedError(3, 4, "forced")),
}


def action(error: BaseException | None) -> Callable[[], str]:
    def run() -> str:
        if error is not None:
            raise error
        return "done"
    return run


def main() -> None:
    rank, port = int(sys.argv[1]), sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    world = dist.group.WORLD
    assert world is not None
    group = hsdp.ReplicaGroup("g", "g/1", rank, 2, init_device_mesh("cpu", (2,)), world)
    # Sharded over the group while both ranks live; gathered again once rank 1 has died.
    sharded = distribute_tensor(torch.arange(4.0), group.mesh, [Shard(0)])
    for case, errors in CASES.items():
        try:
            outcome = group.agreed(action(errors[rank]))
        except Exception as exc:  # the outcome is what the test checks
            outcome = type(exc).__name__
        print(json.dumps([case, outcome]), flush=True)
    if rank == 1:
        os._exit(0)  # dies without a word: its sockets close under rank 0's next allreduce
    try:
        group.agree_max(0)
        outcome = "passed"
    except Exception as exc:
        outcome = type(exc).__name__
    print(json.dumps(["partner-dies", outcome]), flush=True)
    # A functional collective's error (a DTensor gathered): it comes out of torch's op dispatch,
    # under torch.distributed's call; hsdp.run names it as the group's loss all the same.
    try:
        sharded.full_tensor()
        outcome = "passed"
    except RuntimeError as exc:
        outcome = "backend" if hsdp._from_backend(exc) else f"not the backend's: {exc}"
    print(json.dumps(["partner-dies-dtensor", outcome]), flush=True)
    # Raised in code of one's own that torch.distributed calls (here, pickling an object to send),
    # a RuntimeError is not the backend's.
    try:
        dist.broadcast_object_list([_Unpicklable()], src=0)
        outcome = "passed"
    except RuntimeError as exc:
        outcome = "backend" if hsdp._from_backend(exc) else "not the backend's"
    print(json.dumps(["own-error", outcome]), flush=True)


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("an error of the script's own, raised inside torch.distributed's call")


if __name__ == "__main__":
    main()
