"""What the chaos workers record: one JSON line per commit, ``{"pid", "time", "view", "step",
"sha"}``, where sha is the sha256 of the replica's parameters and view the one it trained in."""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from ringserve import api


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
