"""Allreduce on loopback: ringserve against torch.distributed's gloo backend, in the same run.

    python benchmarks/allreduce.py                    # worlds 2 and 4; 64 KiB, 1 MiB, 16 MiB, 64 MiB
    python benchmarks/allreduce.py --worlds 4 --sizes 1M 64M --loop asyncio
    python benchmarks/allreduce.py --worlds 2 --sizes 1M 64M --tls --no-gloo   # TLS overhead only
    sudo .venv/bin/python benchmarks/allreduce.py --between-hosts --rounds 5     # each rank a host (netns)
    sudo .venv/bin/python benchmarks/allreduce.py --between-hosts --tls --worlds 2 --sizes 64M --no-gloo
    python benchmarks/allreduce.py --algorithms auto ring --rounds 5             # auto against the ring
    sudo .venv/bin/python benchmarks/allreduce.py --algorithms auto ring --between-hosts --worlds 8 --per-host 2

For each world and size it prints seconds per op, algorithm bandwidth (S / t), bus bandwidth
(algbw x 2(N-1)/N), the ratios to gloo, the bytes each ringserve worker sent over the ring optimum
2(N-1)/N x S, and the peak memory of a ringserve worker over the tensor at the largest size (the
growth of its resident set from just before the tensor was made, tensor included). Both sides
reduce float32 sums in place (``out=a`` for ringserve) with one compute thread per process.

The workers share one host, so by default ringserve passes payloads through shared memory (only
headers go over the gRPC stream; see ringserve/worker/dataplane/links/shared.py). Two more runs with
shared memory off say what the network path costs on its own, over loopback: with the TCP payload
lane, as between hosts by default, and with every payload over the gRPC stream (``--no-stream``
skips both).

With ``--tls`` ringserve also runs under mTLS with a job token (stream only: on one host, shared
memory would carry the payloads around TLS), from a throwaway CA and certificate made in a
temporary directory, and the table adds its time and its ratio to the stream-only run.

``--between-hosts`` measures between hosts for real: each rank runs in a network namespace of its
own, all joined by veth pairs to one bridge with no rate limit (_veth.py), so there is no loopback
and no shared memory (it is turned off: the namespaces share a kernel). In each of ``--rounds``
interleaved rounds (the order rotated each round) it runs gloo, ringserve with the TCP payload
lane (``RINGSERVE_PAYLOAD_LANE=tcp``: a lane that failed to attach would fail the run rather than
time the stream) and ringserve stream-only (``off``), and reports per size the median over the
rounds of each one's bus bandwidth ratio to the same round's gloo, with the range. With ``--tls``
it adds the lane under mTLS with a token, and its time over the plaintext lane's of the same round.

``--algorithms auto ring`` runs ringserve alone under each setting of RINGSERVE_ALGORITHM named
(a named one flat), in ``--rounds`` interleaved rounds, on one host or ``--between-hosts``, with
``--per-host`` ranks on each host, and reports per cell each one's time, the algorithms each ran
(the workers' counters) and each one's time over the ring's in the same round, median [range]
(_versus.py). It is how ``auto`` is checked never to lose to the ring (docs/design/algorithms.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import PYTHON, free_port, peak_rss_bytes, read_json, rss_bytes, run_ranks, table
from _results import save

from ringserve.selection import SETTINGS as ALGORITHMS

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def iterations(size: int) -> int:
    return max(4, min(60, (256 << 20) // size))


def time_ops(run_once, barrier, size: int, cpu: list[float] | None = None) -> list[float]:
    """Per-op times of a few timed batches, after a warm-up; ``cpu`` gets this process's CPU
    seconds per op (every thread, user and system) over the same batches."""
    n = iterations(size)
    for _ in range(2):
        run_once()
    samples = []
    batches = 3
    per_batch = max(1, n // batches)
    for _ in range(batches):
        barrier()
        t0 = time.perf_counter()
        c0 = time.process_time()
        for _ in range(per_batch):
            run_once()
        samples.append((time.perf_counter() - t0) / per_batch)
        c1 = time.process_time()
        if cpu is not None:
            cpu.append((c1 - c0) / per_batch)
    return samples


def worker_ringserve(args: argparse.Namespace) -> None:
    import ringserve as rs
    from ringserve import api

    rs.init(use_uvloop=args.loop == "uvloop")
    counters = api.context().worker.counters
    results = {}
    for size in args.sizes:
        before_tensor = rss_bytes()
        a = np.ones(size // 4, dtype=np.float32)
        sent0, ops0, chosen0 = counters.bytes_sent, counters.collectives_done, dict(counters.algorithms)
        # In place, as gloo's all_reduce is: no result buffer is allocated per op.
        cpu: list[float] = []
        samples = time_ops(lambda a=a: rs.allreduce(a, op="sum", name="bench", out=a), rs.barrier, size, cpu)
        ops = counters.collectives_done - ops0
        barriers = 3
        sent = (counters.bytes_sent - sent0) / max(1, ops - barriers)
        chosen = {algorithm: n - chosen0.get((op, algorithm), 0) for (op, algorithm), n in counters.algorithms.items()
                  if op == "allreduce" and n > chosen0.get((op, algorithm), 0)}
        results[size] = {"t": statistics.median(samples), "sent": sent, "cpu": statistics.median(cpu),
                         "peak_over_tensor": (peak_rss_bytes() - before_tensor) / size, "algorithms": chosen}
        del a
    pathlib.Path(args.out).write_text(json.dumps(results))
    rs.shutdown()


def worker_gloo(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(__import__("os").environ["RINGSERVE_RANK_HINT"])
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=args.world)
    results = {}
    for size in args.sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        cpu: list[float] = []
        samples = time_ops(lambda t=t: dist.all_reduce(t), dist.barrier, size, cpu)
        results[size] = {"t": statistics.median(samples), "cpu": statistics.median(cpu)}
    pathlib.Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def tls_settings(tmp: pathlib.Path, names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict[str, object]:
    """mTLS and a token from a throwaway CA, as config fields (the workers get them as env); the
    certificate names ``names`` (the addresses that workers and the coordinator are dialled at)."""
    from ringserve.testing.pki import CertificateAuthority

    files = CertificateAuthority("benchmark CA").issue_files(tmp / "pki", "node", names=names)
    return {"tls_cert": files.cert, "tls_key": files.key, "tls_ca": files.ca, "tls_require_client_auth": True,
            "token": "benchmark-token"}


def run_ringserve(world: int, sizes_arg: list[str], loop: str, tmp: pathlib.Path, tag: str,
                  security: dict[str, object], workers: dict[str, object] | None = None) -> None:
    from ringserve import Coordinator, CoordinatorConfig
    from ringserve.loop import LoopThread

    me = str(pathlib.Path(__file__).resolve())
    thread = LoopThread(use_uvloop=True)
    coord = Coordinator(CoordinatorConfig(min_workers=world, max_workers=world, settle_s=0.1, **security))  # type: ignore[arg-type]
    thread.run(coord.start(), 10)
    env = {"RINGSERVE_COORDINATOR": coord.address, **{f"RINGSERVE_{k.upper()}": str(int(v) if isinstance(v, bool) else v)
                                                       for k, v in {**security, **(workers or {})}.items()}}
    try:
        run_ranks([[PYTHON, me, "--role", "ringserve", "--world", str(world), "--loop", loop,
                    "--out", str(tmp / f"{tag}{world}.{i}.json"), "--sizes", *sizes_arg] for i in range(world)],
                  env, timeout_s=900)
    finally:
        thread.run(coord.stop(0.1), 10)
        thread.stop()


# Every payload over the gRPC stream: what a network path cost before the TCP payload lane, and
# the base of the TLS ratio (shared memory would carry the payloads around TLS on one host).
STREAM_ONLY = {"shared_memory": False, "payload_lane": "off"}
# Shared memory off, the TCP payload lane on (the default between hosts), over loopback.
LANE_ONLY = {"shared_memory": False}


def run_world(world: int, sizes: list[int], loop: str, tmp: pathlib.Path, *, tls: bool = False,
              gloo: bool = True, stream: bool = True) -> list[dict[str, object]]:
    sizes_arg = [str(s) for s in sizes]
    me = str(pathlib.Path(__file__).resolve())
    run_ringserve(world, sizes_arg, loop, tmp, "rs", {})
    if stream:
        run_ringserve(world, sizes_arg, loop, tmp, "lane", {}, LANE_ONLY)
        run_ringserve(world, sizes_arg, loop, tmp, "stream", {}, STREAM_ONLY)
    if tls:
        run_ringserve(world, sizes_arg, loop, tmp, "tls", tls_settings(tmp), STREAM_ONLY)
    if gloo:
        port = free_port()
        run_ranks([[PYTHON, me, "--role", "gloo", "--world", str(world), "--port", str(port),
                    "--out", str(tmp / f"gloo{world}.{i}.json"), "--sizes", *sizes_arg] for i in range(world)],
                  {}, timeout_s=900)
    rows = []
    for size in sizes:
        key = str(size)
        rs_t = max(read_json(tmp / f"rs{world}.{i}.json")[key]["t"] for i in range(world))
        gl_t = max(read_json(tmp / f"gloo{world}.{i}.json")[key]["t"] for i in range(world)) if gloo else float("nan")
        tls_t = max(read_json(tmp / f"tls{world}.{i}.json")[key]["t"] for i in range(world)) if tls else float("nan")
        st_t = max(read_json(tmp / f"stream{world}.{i}.json")[key]["t"] for i in range(world)) if stream else float("nan")
        ln_t = max(read_json(tmp / f"lane{world}.{i}.json")[key]["t"] for i in range(world)) if stream else float("nan")
        sent = max(read_json(tmp / f"rs{world}.{i}.json")[key]["sent"] for i in range(world))
        peak = max(read_json(tmp / f"rs{world}.{i}.json")[key]["peak_over_tensor"] for i in range(world))
        factor = 2 * (world - 1) / world
        optimum = factor * size
        rows.append({
            "world": world,
            "size": f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB",
            "rs_ms": f"{rs_t * 1e3:.2f}",
            "gloo_ms": f"{gl_t * 1e3:.2f}",
            "time_ratio": f"{rs_t / gl_t:.2f}",
            "rs_busbw": f"{size / rs_t * factor / 1e9:.2f}",
            "gloo_busbw": f"{size / gl_t * factor / 1e9:.2f}",
            "busbw_ratio": f"{gl_t / rs_t:.2f}",
            "sent_over_opt": f"{sent / optimum:.4f}",
            "peak_mem": f"{peak:.2f}x" if size == max(sizes) else "-",
            "lane_ms": f"{ln_t * 1e3:.2f}" if stream else "-",
            "lane_busbw_ratio": f"{gl_t / ln_t:.2f}" if stream else "-",
            "stream_ms": f"{st_t * 1e3:.2f}" if stream else "-",
            "stream_busbw_ratio": f"{gl_t / st_t:.2f}" if stream else "-",
            "tls_ms": f"{tls_t * 1e3:.2f}" if tls else "-",
            "tls_ratio": f"{tls_t / st_t:.2f}" if tls and stream else "-",
        })
    return rows


COLUMNS = [
    ("world", "world"), ("size", "size"), ("rs_ms", "ringserve ms/op"), ("gloo_ms", "gloo ms/op"),
    ("time_ratio", "time / gloo"), ("rs_busbw", "ringserve busbw GB/s"), ("gloo_busbw", "gloo busbw GB/s"),
    ("busbw_ratio", "busbw / gloo"), ("sent_over_opt", "bytes sent / optimum"), ("peak_mem", "peak mem / tensor"),
]
STREAM_COLUMNS = [("lane_ms", "payload lane ms/op"), ("lane_busbw_ratio", "payload lane busbw / gloo"),
                  ("stream_ms", "stream-only ms/op"), ("stream_busbw_ratio", "stream-only busbw / gloo")]
TLS_COLUMNS = [("tls_ms", "mTLS+token ms/op"), ("tls_ratio", "mTLS / stream-only")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", nargs="+", default=["64K", "1M", "16M", "64M"])
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    p.add_argument("--tls", action="store_true", help="also run ringserve under mTLS with a token; report the ratio")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo runs")
    p.add_argument("--no-stream", action="store_true",
                   help="skip the run with shared memory off (every payload over the gRPC stream)")
    p.add_argument("--between-hosts", action="store_true",
                   help="each rank in a network namespace of its own, on an unlimited bridge (needs root)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of a --between-hosts run")
    p.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=[], metavar="SETTING",
                   help="ringserve alone under each of these RINGSERVE_ALGORITHM settings, interleaved; "
                        "report each one's time over the ring's")
    p.add_argument("--per-host", type=int, default=1, help="ranks on each host, under --algorithms")
    p.add_argument("--role", choices=["main", "ringserve", "gloo", "host"], default="main")
    p.add_argument("--ranks", default="", help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON (benchmarks/plots.py draws them)")
    args = p.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes]
    if args.role == "ringserve":
        return worker_ringserve(args)
    if args.role == "gloo":
        return worker_gloo(args)
    if args.role == "host" or args.algorithms:
        import _versus

        return _versus.host(args) if args.role == "host" else _versus.main(args)
    if args.between_hosts:
        from _between import main as between_hosts

        return between_hosts(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            rows += run_world(world, args.sizes, args.loop, pathlib.Path(tmp), tls=args.tls, gloo=not args.no_gloo,
                              stream=not args.no_stream or args.tls)
    print(f"allreduce of float32 sums on loopback, {args.loop} event loop; bandwidths in GB/s")
    columns = [c for c in COLUMNS if not (args.no_gloo and "gloo" in c[1])]
    if not args.no_stream or args.tls:
        columns += [c for c in STREAM_COLUMNS if not (args.no_gloo and "gloo" in c[1])]
    print(table(rows, columns + (TLS_COLUMNS if args.tls else [])))
    if args.json:
        save(args.json, "allreduce", rows, loop=args.loop)


if __name__ == "__main__":
    main()
