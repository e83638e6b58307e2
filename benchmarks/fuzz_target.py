"""The fuzz campaign's target (benchmarks/fuzz.py starts it): one process that holds every surface
of a live job, and keeps the job working while the campaign throws inputs at it.

It runs, on loopback, with a job token:

- a coordinator with its status page;
- three workers, the first two on one host with a shared directory (their fd-passing socket) and
  the third on a host of its own (the TCP payload lanes), allreducing and checking every sum;
- one parameter-server shard, which one of the workers pushes to and pulls from.

It writes ``surfaces.json`` (every address, port and path, the token, its pid) once all is up,
then ``progress.json`` every second: the collectives and pushes done, the last error of each.
The campaign reads it to tell a job that goes on from one that stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ringserve import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from ringserve.config import PSClientConfig, ShardConfig
from ringserve.ps import AsyncClient, Optimizer, Shard

TOKEN = "fuzz-campaign-token-0123456789abcdef"
FAST = dict(connect_timeout_s=5.0, rendezvous_timeout_s=30.0, collective_timeout_s=30.0, peer_hello_timeout_s=2.0)


async def main(directory: Path) -> None:
    shared = Path(tempfile.mkdtemp(prefix="rs-fz-"))  # short: a Unix socket's path holds 107 bytes
    coordinator = await Coordinator(CoordinatorConfig(token=TOKEN, min_workers=3, max_workers=3, settle_s=0.2,
                                                      http_port=0, heartbeat_timeout_s=5.0)).start()
    hosts = ("host-a", "host-a", "host-b")
    workers = [Worker(config=WorkerConfig(coordinator=coordinator.address, token=TOKEN, hostname=host,
                                          shared_dir=str(shared) if host == "host-a" else "", **FAST))
               for host in hosts]
    await asyncio.gather(*(w.start() for w in workers))
    shard = await Shard(ShardConfig(coordinator=coordinator.address, shards=1, token=TOKEN, use_uvloop=False,
                                    max_wait_s=30.0)).start()
    client = AsyncClient(PSClientConfig(coordinator=coordinator.address, token=TOKEN), worker_id="fuzz-pusher")
    await client.connect()
    await client.init({"w": np.zeros(4096, np.float32)}, mode="async", optimizer=Optimizer(kind="sgd", lr=0.01))
    progress = {"collectives": 0, "pushes": 0, "collective_error": "", "push_error": "", "at": 0.0}

    async def collectives() -> None:
        while True:
            try:
                outs = await asyncio.gather(*(w.allreduce(np.full(1 << 16, w.rank + 1.0, np.float32), op="sum",
                                                          name="fuzzed") for w in workers))
                if any(float(o[0]) != 6.0 or float(o[-1]) != 6.0 for o in outs):
                    progress["collective_error"] = f"a wrong sum: {[float(o[0]) for o in outs]}"
                else:
                    progress["collectives"] += 1
            except Exception as exc:
                progress["collective_error"] = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.02)

    async def pushes() -> None:
        while True:
            try:
                await client.pull()
                await client.push({"w": np.full(4096, 1e-3, np.float32)})
                progress["pushes"] += 1
            except Exception as exc:
                progress["push_error"] = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(collectives()), asyncio.create_task(pushes())]
    for _ in range(600):  # until the lanes and rings are up and their sockets exist
        if progress["collectives"] >= 3:
            break
        await asyncio.sleep(0.1)
    surfaces = {
        "pid": os.getpid(),
        "token": TOKEN,
        "coordinator": coordinator.address,
        "status": coordinator.status_page.url if coordinator.status_page is not None else "",
        "peers": [w.address for w in workers],
        "lanes": [w.node.planes.lanes.server.port for w in workers if w.node.planes.lanes.server is not None],
        "fd_sockets": sorted(glob.glob(str(shared / "rs-*.sock"))),
        "shard": shard.address,
    }
    (directory / "surfaces.json").write_text(json.dumps(surfaces))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # the campaign's end
    try:
        while not stop.is_set():
            progress["at"] = time.time()
            (directory / "progress.tmp").write_text(json.dumps(progress))
            os.replace(directory / "progress.tmp", directory / "progress.json")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        for task in tasks:
            task.cancel()
        shutil.rmtree(shared, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
