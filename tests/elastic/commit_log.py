"""What the chaos workers record: one JSON line per commit, ``{"pid", "time", "view", "step",
"sha"}``, where sha is the sha256 of the replica's parameters and view the one it trained in.

With HOLD_FRESH_SYNC=PATH in the environment, every fresh process that syncs after the job has
committed (a restarted worker, admitted into a view with the workers holding the state) appends its
pid to PATH and waits, before it takes the state, until PATH.go exists (30 s at most): a test can
then kill every holder while fresh workers are in the view without the state."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from typing import IO, Any

from ringserve import api

# SIGUSR1 prints every thread's Python stack to stderr: the chaos campaign sends it to a job that
# hangs, so that its output says where each worker waits.
faulthandler.register(signal.SIGUSR1, all_threads=True)


class CommitLog:
    """Mixin for an elastic state: after each commit's save, appends the record to ``log``.

    Saves outside a commit (the state's first save, a sync) are not commits and are not logged.
    """

    log: IO[str]
    step: int
    committing = False

    def commit(self) -> None:
        self.committing = True
        try:
            super().commit()  # type: ignore[misc]
        finally:
            self.committing = False

    def save(self) -> None:
        super().save()  # type: ignore[misc]
        if self.committing:
            record: dict[str, Any] = {
                "pid": os.getpid(), "time": time.time(), "view": api.context().worker.running_view,
                "step": self.step, "sha": self.digest(),
            }
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def digest(self) -> str:
        raise NotImplementedError

    def take(self, root: int) -> None:
        hold = os.environ.get("HOLD_FRESH_SYNC", "")
        if hold and self.commits == 0 and os.path.getsize(self.log.name) and not os.path.exists(hold + ".go"):  # type: ignore[attr-defined]
            with open(hold, "a") as f:
                f.write(f"{os.getpid()}\n")
            deadline = time.time() + 30
            while not os.path.exists(hold + ".go") and time.time() < deadline:
                time.sleep(0.02)
        super().take(root)  # type: ignore[misc]
