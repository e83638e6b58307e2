"""DDP on a one-rank process group whose ops complete through ringserve's Work; the third fails.

Prints, as its last line, a JSON list of what each of three backward passes did ("ok", or the
first line of what it raised). A process of its own: before the fix, DDP crashed it.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ringserve.errors import PeerUnavailableError
from ringserve.torch.distributed.work import Completer, RingserveWork


def completing(value: Any, error: BaseException | None) -> concurrent.futures.Future[Any]:
    """A future completed a little later by another thread, as ringserve's loop completes its calls."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        time.sleep(0.02)
        future.set_exception(error) if error is not None else future.set_result(value)

    threading.Thread(target=run).start()
    return future


class _OneRank(dist.ProcessGroup):
    """A one-rank group whose ops complete through ringserve's Work; the third all_reduce fails."""

    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]
        self.completer = Completer(10.0)
        self.calls = 0

    def getBackendName(self) -> str:
        return "one-rank"

    def _done(self, value: Any, error: BaseException | None = None) -> RingserveWork:
        return self.completer.track("op", [completing(value, error)], lambda r: r[0])

    def broadcast(self, tensors: Any, opts: Any = None) -> RingserveWork:
        return self._done(tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> RingserveWork:
        for o, i in zip(outputs[0], inputs, strict=True):
            o.copy_(i)
        return self._done(outputs)

    def allreduce(self, tensors: Any, opts: Any = None) -> RingserveWork:
        self.calls += 1
        return self._done(tensors, PeerUnavailableError("gone") if self.calls == 3 else None)


def main() -> None:
    group = _OneRank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    outcomes = []
    for _ in range(3):
        try:
            model(torch.randn(2, 4)).sum().backward()
            outcomes.append("ok")
        except RuntimeError as exc:
            outcomes.append(str(exc).splitlines()[0])
    group.completer.close()
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
