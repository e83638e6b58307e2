"""The floor of the stream path: a ring allreduce's bytes over bare Python gRPC, and over TCP, against gloo.

    python benchmarks/stream_floor.py                        # worlds 2 and 4, 64 MiB, 2 MiB chunks
    python benchmarks/stream_floor.py --worlds 4 --size 16M --streams 1 2 4

No ringserve code runs here. Each of W processes sends its ring successor, in chunks, exactly the
bytes a ring allreduce of ``--size`` sends (2(W-1)/W of it) while it receives as many from its
predecessor, and does nothing else: no reduction, no frame encoding (the sender writes one
prepared bytes object again and again), no dependency of a send on a receive. So its time is a
lower bound on any allreduce over that transport in Python on this machine, and its "bus bandwidth
/ gloo" an upper bound on what ringserve's stream-only column can reach. Transports:

- ``grpc xK``: K grpc.aio client streams per ring edge, each on a connection of its own (chunks
  dealt round-robin), with ringserve's channel and server options, written as ringserve's
  StreamLink writes them, over loopback TCP;
- ``tcp``: one plain TCP connection per edge, written with ``sock_sendall`` from a memoryview and
  read with ``sock_recv_into`` into a preallocated buffer (the kernel's two copies, no others):
  what a payload lane beside the gRPC stream would cost.

gloo's allreduce of the same float32 tensor, and ringserve's own allreduce with every payload over
the stream (allreduce.py's stream-only column), run in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import PYTHON, free_port, read_json, run_ranks, table
from allreduce import STREAM_ONLY, parse_size, run_ringserve, worker_gloo

METHOD = "/floor.Floor/Stream"
ROUNDS = 8


def _plan(args: argparse.Namespace) -> tuple[int, int]:
    """(chunk bytes, chunks per op) of one rank: 2(W-1) segments of size/W, in chunks."""
    segment = args.size // args.world
    per_segment = max(1, -(-segment // args.chunk))
    return -(-segment // per_segment), 2 * (args.world - 1) * per_segment


async def _wait_file(path: pathlib.Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        await asyncio.sleep(0.01)
    return path.read_text()


async def _timed(send: Callable[[], Awaitable[None]], receive: Callable[[], Awaitable[None]]) -> list[float]:
    """Seconds per op of ROUNDS ops, each one rank's sends and receives at once, after a warm-up."""
    times = []
    for _ in range(ROUNDS + 1):
        t0 = time.perf_counter()
        await asyncio.gather(send(), receive())
        times.append(time.perf_counter() - t0)
    return times[1:]


async def _grpc_rank(args: argparse.Namespace, rank: int, tmp: pathlib.Path) -> list[float]:
    import grpc

    chunk, count = _plan(args)
    got: asyncio.Queue[int] = asyncio.Queue()

    async def stream(requests, context):
        async for message in requests:
            got.put_nowait(len(message))
        return b""

    from ringserve.config import WorkerConfig
    from ringserve.transport import channel_options, server_options

    limit = WorkerConfig().max_message_bytes  # ringserve's own channel and server options
    server = grpc.aio.server(options=server_options(limit))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "floor.Floor", {"Stream": grpc.stream_unary_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    (tmp / f"port.{rank}").write_text(str(port))
    successor = int(await _wait_file(tmp / f"port.{(rank + 1) % args.world}"))
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{successor}", options=[*channel_options(limit), ("grpc.channel_id", k)])
                for k in range(args.streams[0])]
    calls = [ch.stream_unary(METHOD)() for ch in channels]
    payload = os.urandom(chunk)

    async def send() -> None:
        for i in range(count):
            await calls[i % len(calls)].write(payload)

    async def receive() -> None:
        for _ in range(count):
            await got.get()

    times = await _timed(send, receive)
    for call in calls:
        await call.done_writing()
        await call
    for ch in channels:
        await ch.close()
    await server.stop(1)
    return times


async def _tcp_rank(args: argparse.Namespace, rank: int, tmp: pathlib.Path) -> list[float]:
    loop = asyncio.get_running_loop()
    chunk, count = _plan(args)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    (tmp / f"port.{rank}").write_text(str(listener.getsockname()[1]))
    successor = int(await _wait_file(tmp / f"port.{(rank + 1) % args.world}"))
    out = socket.socket()
    out.setblocking(False)
    await loop.sock_connect(out, ("127.0.0.1", successor))
    inbound, _ = await loop.sock_accept(listener)
    for s in (out, inbound):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(os.urandom(chunk))
    into = memoryview(bytearray(chunk))

    async def send() -> None:
        for _ in range(count):
            await loop.sock_sendall(out, payload)

    async def receive() -> None:
        left = count * chunk
        while left:
            n = await loop.sock_recv_into(inbound, into[: min(chunk, left)])
            if not n:
                raise ConnectionError("the predecessor closed its connection")
            left -= n

    times = await _timed(send, receive)
    for s in (out, inbound, listener):
        s.close()
    return times


def worker(args: argparse.Namespace) -> None:
    import uvloop

    rank = int(os.environ["RINGSERVE_RANK_HINT"])
    body = _tcp_rank if args.transport == "tcp" else _grpc_rank
    times = uvloop.run(asyncio.wait_for(body(args, rank, pathlib.Path(args.tmp)), 600))
    pathlib.Path(args.out).write_text(json.dumps({"t": statistics.median(times)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size", default="64M")
    parser.add_argument("--chunk", default="2M")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2], help="gRPC streams per ring edge")
    parser.add_argument("--role", choices=["floor", "gloo"], help=argparse.SUPPRESS)
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "gloo":
        return worker_gloo(args)
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    if args.role == "floor":
        args.size, args.chunk = size, chunk
        return worker(args)

    me = str(pathlib.Path(__file__).resolve())
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        for world in args.worlds:
            port = free_port()
            gloo_argv = [[PYTHON, me, "--role", "gloo", "--world", str(world), "--port", str(port),
                          "--out", str(tmp / f"gloo{world}.{i}.json"), "--sizes", str(size)] for i in range(world)]
            run_ranks(gloo_argv, {"OMP_NUM_THREADS": "1"}, timeout_s=900)
            gloo = read_json(tmp / f"gloo{world}.0.json")[str(size)]["t"]
            busbw = 2 * (world - 1) / world * size
            rows.append({"world": world, "transport": "gloo allreduce", "ms": f"{gloo * 1e3:.2f}",
                         "busbw": f"{busbw / gloo / 1e9:.2f}", "ratio": "1.00"})
            run_ringserve(world, [str(size)], "uvloop", tmp, "stream", {}, STREAM_ONLY)
            t = max(read_json(tmp / f"stream{world}.{i}.json")[str(size)]["t"] for i in range(world))
            rows.append({"world": world, "transport": "ringserve allreduce, stream-only", "ms": f"{t * 1e3:.2f}",
                         "busbw": f"{busbw / t / 1e9:.2f}", "ratio": f"{gloo / t:.2f}"})
            for transport in [*(f"grpc x{k}" for k in args.streams), "tcp"]:
                run = tmp / f"{transport.replace(' ', '')}.{world}"
                run.mkdir()
                streams = transport.split("x")[-1] if transport.startswith("grpc") else "1"
                argv = [[PYTHON, me, "--role", "floor", "--transport", transport.split()[0], "--world", str(world),
                         "--size", str(size), "--chunk", str(chunk), "--streams", streams, "--tmp", str(run),
                         "--out", str(run / f"out.{i}.json")] for i in range(world)]
                run_ranks(argv, {"OMP_NUM_THREADS": "1"}, timeout_s=900)
                t = max(read_json(run / f"out.{i}.json")["t"] for i in range(world))
                rows.append({"world": world, "transport": f"{transport}, bytes only", "ms": f"{t * 1e3:.2f}",
                             "busbw": f"{busbw / t / 1e9:.2f}", "ratio": f"{gloo / t:.2f}"})
    print(f"\n{args.size} per op (a ring allreduce's bytes), {args.chunk} chunks; the time of the slowest rank")
    print(table(rows, [("world", "world"), ("transport", "what moves the bytes"), ("ms", "ms/op"),
                       ("busbw", "busbw GB/s"), ("ratio", "busbw / gloo's allreduce")]))


if __name__ == "__main__":
    main()
