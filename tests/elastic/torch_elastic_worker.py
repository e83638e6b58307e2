"""An elastic torch training loop for the chaos tests (DistributedOptimizer + TorchState).

Usage: torch_elastic_worker.py LOG STEPS PAUSE_S

Every commit appends ``{"pid", "time", "view", "step", "sha"}`` to LOG, the sha256 of the
model's parameters.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
from commit_log import CommitLog

import ringserve.torch as hvd
from ringserve import api
from ringserve.torch import elastic


def claim(marker: str) -> bool:
    """Whether this process is the first to create ``marker``."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main() -> None:
    log_path, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(1234 + os.getpid())  # different everywhere: the sync makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters())

    class Logged(CommitLog, elastic.TorchState):
        log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (held for the process's life)

        def digest(self) -> str:
            digest = hashlib.sha256()
            for tensor in model.state_dict().values():
                digest.update(tensor.detach().contiguous().numpy().tobytes())
            return digest.hexdigest()

        def _hand_over(self, root: int) -> None:
            # DIE_AT_HANDOFF=PATH (test_handoff.py): the first root that is to send the state to a
            # rank lacking it dies instead, before sending anything (PATH claims it, once).
            marker = os.environ.get("DIE_AT_HANDOFF")
            lacking = [r for r in range(hvd.size()) if r not in self.holding]
            if marker and hvd.rank() == root and lacking and claim(marker):
                print(f"root {root} dies before handing the state to ranks {lacking}", flush=True)
                os._exit(9)
            super()._hand_over(root)

    state = Logged(model=model, optimizer=optimizer, step=0)

    @elastic.run
    def train(state: Logged) -> None:
        while state.step < steps:
            g = torch.Generator().manual_seed(state.step * 7919 + hvd.rank())
            x = torch.randn(16, 32, generator=g)
            y = torch.randint(0, 4, (16,), generator=g)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            time.sleep(pause)
            if state.step == steps - 1 and os.environ.get("HOLD_FOR_JOINER"):
                # (test_handoff.py) The commit before the last waits until a joiner is ready, so
                # that the last commit admits it: the members then end right after its sync.
                deadline = time.monotonic() + 60
                while api.context().worker.pending_workers == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
            state.commit()

    train(state)
    # The allreduces this process ran (tests/elastic/test_rides.py): one a step where each commit's
    # check rides on the step's gradient allreduce (a single bucket here), two where it does not.
    # And the broadcasts: none in a joiner, which takes the state point to point (test_handoff.py).
    latency = api.context().worker.counters.latency
    allreduces, broadcasts = (latency[op].count if op in latency else 0 for op in ("allreduce", "broadcast"))
    print(f"finished at step {state.step} after {allreduces} allreduces and {broadcasts} broadcasts", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
