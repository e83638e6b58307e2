"""One rank of the failure worlds: training until the last rank kills itself, then what survives.

    dist_die.py OUT_DIR MODE        (MODE: allreduce | ddp | wait | future | p2p | p2p-idle)

The last rank SIGKILLs itself at step 10, after writing the time to OUT_DIR/killed. Every other
rank goes on until its op fails, and records what it raised, how long after the kill, and what
the next op raises, in OUT_DIR/rank{r}.json. In ``p2p`` mode (a world of 3) each survivor waits on
the last rank in its own way: rank 0 in a recv of what the last rank sends it every step, rank 1
in an all_reduce of the subgroup [1, 2]. In ``p2p-idle`` mode rank 1 waits in a recv from the last
rank, which never sends it anything (no stream of the last rank reaches rank 1), while rank 0 and
the last rank all_reduce in the subgroup [0, 2].
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ringserve.torch.distributed  # noqa: F401


def describe(exc: BaseException, killed_at: float) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc).splitlines()[0], "after_s": time.time() - killed_at,
            "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ringserve", rank=rank, world_size=size)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pair = dist.new_group([0 if mode == "p2p-idle" else 1, size - 1]) if mode.startswith("p2p") else None
    waits = 1 if mode == "p2p-idle" else 0  # the rank that waits in a recv
    seen: dict[str, Any] = {}
    started = time.time()
    try:
        for step in range(100_000):
            if step == 10 and rank == size - 1:
                (out / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "ddp":
                optimizer.zero_grad()
                model(torch.randn(16, 256)).sum().backward()
                optimizer.step()
            elif mode.startswith("p2p"):
                if rank == waits:
                    dist.recv(torch.zeros(50_000), src=size - 1, tag=3)
                else:
                    if rank == size - 1 and mode == "p2p":
                        dist.send(torch.ones(50_000), dst=0, tag=3)
                    dist.all_reduce(torch.ones(50_000), group=pair)
            elif mode in ("wait", "future"):
                works = [dist.all_reduce(torch.ones(50_000), async_op=True) for _ in range(4)]
                for w in works:
                    w.wait() if mode == "wait" else w.get_future().wait()
            else:
                dist.all_reduce(torch.ones(50_000))
            time.sleep(0.005)
        seen["error"] = None
    except Exception as exc:
        killed_at = float((out / "killed").read_text())
        seen["error"] = describe(exc, killed_at)
        try:
            dist.all_reduce(torch.ones(1))
            seen["next"] = None
        except Exception as nxt:
            seen["next"] = describe(nxt, killed_at)
    seen["ran_s"] = time.time() - started
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
