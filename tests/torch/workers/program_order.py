"""One rank: which of its backend's ops ringserve takes for ones made through torch.distributed's
Python functions (work.from_python_api: the first caller outside ringserve is c10d's module).

    program_order.py OUT_DIR

Records, for each op the backend makes, whether it was taken as a Python call: a
``dist.all_reduce``, a ``dist.broadcast`` and a ``dist.barrier`` (all three must be), then the
allreduces DDP's reducer makes from C++ in a backward pass with no comm hook (none may be). Saves
``{"python": [...], "reducer": [...]}`` to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ringserve.torch  # noqa: F401  registers the backend
from ringserve.torch.distributed import work

made: list[bool] = []
# The recorder runs between the backend and the work it makes, so it must be skipped by the walk up
# the stack as ringserve's own frames are: it is compiled in a namespace named as a ringserve module.
_recorder: dict[str, Any] = {"__name__": "ringserve.tests.recorder", "init": work.RingserveWork.__init__, "made": made}
exec("def recording_init(self, *args, **kwargs):\n    init(self, *args, **kwargs)\n    made.append(self._program_order)\n",
     _recorder)
work.RingserveWork.__init__ = _recorder["recording_init"]  # type: ignore[method-assign]


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ringserve", rank=rank, world_size=size)
    made.clear()
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    python = list(made)
    model = DDP(torch.nn.Linear(8, 2))
    made.clear()
    model(torch.randn(4, 8)).sum().backward()
    reducer = list(made)
    (out / f"rank{rank}.json").write_text(json.dumps({"python": python, "reducer": reducer}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
