"""An elastic DiLoCo training loop for the elastic tests (ringserve.torch.DiLoCo + TorchState).

Usage: diloco_worker.py LOG STEPS PAUSE_S, configured by DILOCO_SYNC_EVERY (5), DILOCO_FRAGMENTS
(1), DILOCO_DELAY (default: DiLoCo's), DILOCO_COMMIT ("outer": after each outer step, when no
sync is in flight; "step": after every inner step, syncs in flight or not) and DILOCO_MIN_SIZE
(training goes on past STEPS until the world has had that many workers for two rounds: a test's
joiner, however slow to start, always gets in and trains).

Every commit appends ``{"pid", "time", "view", "step", "sha"}`` to LOG: sha is the sha256
of the global copy and the outer momentum, which every rank of a view must hold alike.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
from commit_log import CommitLog

import ringserve.torch as hvd
from ringserve.torch import elastic
from ringserve.torch.diloco import STATE_KEY


def main() -> None:
    log_path, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    sync_every = int(os.environ.get("DILOCO_SYNC_EVERY", "5"))
    fragments = int(os.environ.get("DILOCO_FRAGMENTS", "1"))
    delay = int(os.environ["DILOCO_DELAY"]) if "DILOCO_DELAY" in os.environ else None
    every_step = os.environ.get("DILOCO_COMMIT", "outer") == "step"
    min_size = int(os.environ.get("DILOCO_MIN_SIZE", "0"))
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(1234 + os.getpid())  # different everywhere: the first sync makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hvd.DiLoCo(model, inner=torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=sync_every,
                     fragments=fragments, fragment_sync_delay=delay, compression="int8")

    class Logged(CommitLog, elastic.TorchState):
        log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (held for the process's life)

        def digest(self) -> str:
            digest = hashlib.sha256()
            outer = opt.state_dict()[STATE_KEY]
            for tensor in [*outer["global"], *(m for m in outer["momentum"] if m is not None)]:
                digest.update(tensor.contiguous().numpy().tobytes())
            return digest.hexdigest()

    state = Logged(model=model, optimizer=opt, step=0, full_at=-1)

    @elastic.run
    def train(state: Logged) -> None:
        while True:
            if state.full_at < 0 and hvd.size() >= min_size:
                state.full_at = state.step
            if state.step >= max(steps, state.full_at + 2 * sync_every) and state.full_at >= 0:
                break
            g = torch.Generator().manual_seed(state.step * 7919 + hvd.rank())
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            time.sleep(pause)
            if every_step or (opt.in_flight == 0 and state.step % sync_every == 0):
                state.commit()

    train(state)
    opt.close()
    print(f"finished at step {state.step}, {opt.outer_steps} outer steps", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
