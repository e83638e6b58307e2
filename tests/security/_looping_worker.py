"""A worker process that runs allreduces until its stdin closes, for tests that measure it from outside.

Usage: python _looping_worker.py   (settings from RINGSERVE_* variables)

It prints ``address ADDRESS`` once it is in a view, then ``done VIEW SIZE SUM`` after each
allreduce of ones (so SUM must equal SIZE), and rides view changes as elastic training does: a
recoverable error means wait for a newer view. SIGUSR1 trims the heap and prints ``trimmed``. It
closes its worker and exits 0 when stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import signal
import sys

import numpy as np

from ringserve import RecoverableError, Worker, WorkerConfig


async def loop(worker: Worker) -> None:
    while True:
        view = worker.running_view
        try:
            out = await worker.allreduce(np.ones(256, dtype=np.float32), op="sum", name="tick")
        except RecoverableError:
            await worker.wait_for_view(newer_than=view, timeout_s=20)
            continue
        print(f"done {view} {worker.size} {out[0]:g}", flush=True)
        await asyncio.sleep(0.02)


def trim(signum: int, frame: object) -> None:
    """SIGUSR1: give the heap's free memory back to the system, so that what RSS shows next is
    what the process still holds, not what glibc keeps for reuse (the data path keeps a lot)."""
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    print("trimmed", flush=True)


async def main() -> None:
    signal.signal(signal.SIGUSR1, trim)
    async with Worker(config=WorkerConfig.from_env()) as worker:
        print(f"address {worker.address}", flush=True)
        stdin_closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        task = asyncio.create_task(loop(worker))
        _, _ = await asyncio.wait([task, stdin_closed], return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


if __name__ == "__main__":
    asyncio.run(main())
