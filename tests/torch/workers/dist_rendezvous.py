"""One rank of the rendezvous worlds: init_process_group("ringserve") the ways a job starts.

    dist_rendezvous.py OUT_DIR MODE

- ``env``: ``init_process_group("ringserve", rank=RANK, world_size=WORLD_SIZE)`` (env://, with or
  without RINGSERVE_COORDINATOR);
- ``init_method``: ``init_method="ringserve://<RINGSERVE_COORDINATOR>"`` and no rank or size;
- ``wrong_size``: ``init_method="ringserve://..."`` with a world_size one more than the world has;
  the error is recorded (under env://, torch's own store would wait for the missing rank first);
- ``hvd_first``: ``ringserve.torch.init()`` first: the group shares that worker, and destroying
  the group leaves it running;
- ``compression``: RINGSERVE_COMPRESSION chooses all_reduce's codec.

What each rank saw goes to OUT_DIR/rank{RANK}.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ringserve
import ringserve.torch as hvd


def sums(size: int) -> bool:
    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return bool(torch.equal(t, torch.full((4,), float(size * (size + 1) // 2))))


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank, size = int(os.environ.get("RANK", "-1")), int(os.environ["WORLD_SIZE"])
    seen: dict[str, Any] = {"mode": mode}
    if mode == "init_method":
        dist.init_process_group("ringserve", init_method=f"ringserve://{os.environ['RINGSERVE_COORDINATOR']}")
        rank = dist.get_rank()
        store = dist.distributed_c10d._get_default_store()  # torch's store, served by the view's rank 0
        store.set(f"hello{rank}", str(rank))
        seen["store"] = [store.get(f"hello{r}").decode() for r in range(size)]
    elif mode == "wrong_size":
        try:
            dist.init_process_group("ringserve", init_method=f"ringserve://{os.environ['RINGSERVE_COORDINATOR']}",
                                    rank=rank, world_size=size + 1)
        except ValueError as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"
            seen["initialized"] = dist.is_initialized()
            seen["ringserve_running"] = ringserve.is_initialized()
        (out / f"rank{rank}.json").write_text(json.dumps(seen))
        return
    elif mode == "hvd_first":
        hvd.init()
        dist.init_process_group("ringserve", rank=rank, world_size=size)
    else:
        dist.init_process_group("ringserve", rank=rank, world_size=size)
    seen.update(rank=dist.get_rank(), size=dist.get_world_size(), backend=dist.get_backend(), sums=sums(size))
    if mode == "compression":
        # int8 on the wire: a sum of values that int8 cannot hold exactly comes back rounded, and
        # identically on every rank.
        t = torch.linspace(-1, 1, 1000) * (rank + 1.37)
        dist.all_reduce(t)
        exact = sum(torch.linspace(-1, 1, 1000) * (r + 1.37) for r in range(size))
        seen["rounded"] = not torch.equal(t, exact)
        seen["close"] = bool(torch.allclose(t, exact, atol=0.05))
        digest: list[Any] = [None] * size
        dist.all_gather_object(digest, t.tolist())
        seen["identical"] = all(d == digest[0] for d in digest)
    dist.destroy_process_group()
    seen["ringserve_running_after"] = ringserve.is_initialized()
    if mode == "hvd_first":
        # The group did not start this worker, so it did not stop it either.
        seen["hvd_after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
        hvd.shutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
