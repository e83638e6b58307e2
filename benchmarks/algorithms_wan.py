"""Allreduce algorithms over an emulated WAN: 16 workers on 8 hosts, against the ring and gloo.

    sudo .venv/bin/python benchmarks/algorithms_wan.py                       # every configuration
    sudo .venv/bin/python benchmarks/algorithms_wan.py --configs ring,auto --sizes 65536

Eight hosts (``--hosts``) run in network namespaces, ``--delay-ms`` (20) one way from each other
behind ``--rate-mbit`` (100) uplinks (benchmarks/_netem.py, as benchmarks/wan.py), two workers
(``--per-host``) on each, named by host (RINGSERVE_HOSTNAME), so that the hierarchical allreduce
sees them. A host's workers share a PID namespace of their own, so that they pass payloads through
the shared-memory lane as workers of one machine do, and workers of two hosts cannot (they share
this kernel, but not each other's /proc): between hosts every byte crosses the emulated link.
Each configuration starts
a coordinator and the 16 workers afresh, and each worker allreduces a float32 vector of each size
(``--sizes``: 64 KiB and 64 MiB), after one untimed call (which measures the links under
``auto``), ``--iterations`` times back to back; a size's time is the slowest rank's mean.

Configurations: ``ring`` (the flat ring: RINGSERVE_ALGORITHM=ring, RINGSERVE_HIERARCHICAL=0),
``ring-hier`` (the ring by host, the default before algorithms were chosen), ``auto`` (the
default: by host where hosts hold several workers, each stage's algorithm chosen), ``auto-flat``,
each algorithm flat (``halving_doubling``, ``tree``, ``ring2d``), ``auto-fp16`` (auto under the
fp16 codec), and ``gloo`` (torch.distributed's allreduce over gloo, same processes and links).

The inputs are small integers, so every sum is exact: every ringserve configuration must give every
rank the bytes the flat ring gives (a sha256 of the result), and ``auto-fp16`` stays within fp16's
bound. It prints each configuration's time per size and its ratio to the flat ring's and to
gloo's, and checks the issue's bounds: 64 KiB under auto <= 0.3x the ring; 64 MiB no slower.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import OPEN_COORDINATOR, PYTHON, read_json, table
from _netem import DEVICE, EmulationUnavailable, Host, Wan, check_environment

CONFIGS: dict[str, dict[str, str]] = {
    "ring": {"RINGSERVE_ALGORITHM": "ring", "RINGSERVE_HIERARCHICAL": "0"},
    "ring-hier": {"RINGSERVE_ALGORITHM": "ring", "RINGSERVE_HIERARCHICAL": "auto"},
    "auto": {"RINGSERVE_ALGORITHM": "auto", "RINGSERVE_HIERARCHICAL": "auto"},
    "auto-flat": {"RINGSERVE_ALGORITHM": "auto", "RINGSERVE_HIERARCHICAL": "0"},
    "halving_doubling": {"RINGSERVE_ALGORITHM": "halving_doubling", "RINGSERVE_HIERARCHICAL": "0"},
    "tree": {"RINGSERVE_ALGORITHM": "tree", "RINGSERVE_HIERARCHICAL": "0"},
    "ring2d": {"RINGSERVE_ALGORITHM": "ring2d", "RINGSERVE_HIERARCHICAL": "0"},
    "auto-fp16": {"RINGSERVE_ALGORITHM": "auto", "RINGSERVE_HIERARCHICAL": "auto", "CODEC": "fp16"},
    "gloo": {},
}
_ports = itertools.count(29500)


def inputs(rank: int, count: int) -> Any:
    import numpy as np

    return ((np.arange(count, dtype=np.int64) * 7 + rank * 13) % 17 - 8).astype(np.float32)


def exact(world: int, count: int) -> Any:
    return sum(inputs(r, count).astype("float64") for r in range(world))


# -- one rank ---------------------------------------------------------------------------------------

def rank_main(args: argparse.Namespace) -> None:
    import numpy as np

    sizes = [int(s) for s in args.sizes.split(",")]
    world = args.world
    codec = os.environ.get("CODEC") or None
    out: dict[str, Any] = {"sizes": {}}
    if args.config == "gloo":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=world)

        def reduce(x: Any, name: str) -> Any:
            t = torch.from_numpy(x.copy())
            dist.all_reduce(t)
            return t.numpy()
        finish = dist.destroy_process_group
    else:
        import ringserve as rs

        rs.init()

        def reduce(x: Any, name: str) -> Any:
            return rs.allreduce(x, op="sum", name=name, compression=codec)
        finish = rs.shutdown
    for nbytes in sizes:
        count = nbytes // 4
        x = inputs(args.rank, count)
        result = reduce(x, f"s{nbytes}")  # untimed: the first of a view measures the links
        iterations = args.iterations if nbytes <= 1 << 20 else args.large_iterations
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(iterations):
            result = reduce(x, f"s{nbytes}")
        mean = (time.perf_counter() - started) / iterations
        cpu = (time.process_time() - cpu) / iterations  # every thread of this rank
        error = float(np.abs(result.astype(np.float64) - exact(world, count)).max()) if count else 0.0
        out["sizes"][str(nbytes)] = {"seconds": mean, "cpu_seconds": cpu, "sha": hashlib.sha256(result.tobytes()).hexdigest(),
                                     "error": error, "scale": float(np.abs(exact(world, count)).max())}
    if args.config != "gloo":
        from ringserve import api

        counts = api.context().worker.counters.algorithms
        out["algorithms"] = sorted({f"{op}:{a}" for (op, a) in counts if op == "allreduce"})
    pathlib.Path(args.out).write_text(json.dumps(out))
    finish()


# -- the driver -------------------------------------------------------------------------------------

def run_config(wan: Wan, args: argparse.Namespace, name: str, tmp: pathlib.Path) -> list[dict[str, Any]]:
    hosts: list[Host] = wan.hosts
    world = len(hosts) * args.per_host
    env = {k: v for k, v in CONFIGS[name].items()}
    coordinator = None
    master = f"{hosts[0].address}:{next(_ports)}"
    if name != "gloo":
        port = next(_ports)
        coordinator = subprocess.Popen(wan.command(hosts[0], [
            PYTHON, "-m", "ringserve.cli", "coordinator", "--host", hosts[0].address, "--port", str(port),
            "--min-workers", str(world), "--max-workers", str(world),
            # On a loaded 2-core machine a worker's heartbeat can starve past the 5 s default, and
            # a view change mid-run measures nothing: the data plane is what is measured here.
            "--heartbeat-timeout", str(args.heartbeat_timeout)], OPEN_COORDINATOR))
        wan.wait_listening(hosts[0], port, timeout_s=60)
        env.update({"RINGSERVE_COORDINATOR": f"{hosts[0].address}:{port}",
                    "RINGSERVE_COLLECTIVE_TIMEOUT_S": str(args.timeout), "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "300"})
    procs, outs = [], []
    try:
        for host in hosts:
            ranks = range(host.index * args.per_host, (host.index + 1) * args.per_host)
            outs += [tmp / f"{name}.{rank}.json" for rank in ranks]
            argv = ["unshare", "--pid", "--fork", "--mount-proc", PYTHON, str(pathlib.Path(__file__).resolve()),
                    "--role", "host", "--config", name, "--ranks", ",".join(map(str, ranks)), "--world", str(world),
                    "--sizes", args.sizes, "--master", master, "--iterations", str(args.iterations),
                    "--large-iterations", str(args.large_iterations), "--out", str(tmp / name)]
            host_env = {"RINGSERVE_BIND_HOST": host.address, "RINGSERVE_HOSTNAME": f"h{host.index}",
                        "GLOO_SOCKET_IFNAME": DEVICE, **env}
            procs.append(subprocess.Popen(wan.command(host, argv, host_env),
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
        deadline = time.monotonic() + args.timeout
        for i, p in enumerate(procs):
            code = p.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{name}: host {i} exited with code {code}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if coordinator is not None:
            coordinator.terminate()
            coordinator.wait(10)
    wan.check_switch()
    return [read_json(o) for o in outs]


def host_main(args: argparse.Namespace) -> None:
    """One host: its ranks, in the PID namespace of this host alone (``unshare --pid``), so that
    ranks of one host reach each other's shared-memory lanes through /proc and ranks of two hosts
    cannot (their payloads then cross the emulated link, as between machines)."""
    procs = []
    for rank in map(int, args.ranks.split(",")):
        argv = [PYTHON, str(pathlib.Path(__file__).resolve()), "--role", "rank", "--config", args.config,
                "--rank", str(rank), "--world", str(args.world), "--sizes", args.sizes, "--master", args.master,
                "--iterations", str(args.iterations), "--large-iterations", str(args.large_iterations),
                "--out", f"{args.out}.{rank}.json"]
        procs.append(subprocess.Popen(argv, env={**os.environ, "RINGSERVE_RANK_HINT": str(rank)}))
    codes = [p.wait() for p in procs]
    raise SystemExit(max(abs(c) for c in codes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="driver")
    parser.add_argument("--config", default="")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks", default="")
    parser.add_argument("--world", type=int, default=0)
    parser.add_argument("--master", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--sizes", default=f"{64 << 10},{64 << 20}")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--large-iterations", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default="")
    parser.add_argument("--heartbeat-timeout", type=float, default=60.0)
    args = parser.parse_args()
    if args.role == "rank":
        rank_main(args)
        return
    if args.role == "host":
        host_main(args)
        return
    try:
        check_environment()
    except EmulationUnavailable as exc:
        raise SystemExit(f"cannot emulate the WAN here: {exc}") from None
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rs-algo-wan-") as tmp, \
            Wan(args.hosts, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as wan:
        for name in args.configs.split(","):
            started = time.monotonic()
            results[name] = run_config(wan, args, name, pathlib.Path(tmp))
            print(f"{name}: done in {time.monotonic() - started:.0f} s", flush=True)
    report(results, args)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    sizes = args.sizes.split(",")
    rows = []
    for name, ranks in results.items():
        row: dict[str, object] = {"config": name, "ran": ",".join(ranks[0].get("algorithms", [])) or "-"}
        for s in sizes:
            t = max(r["sizes"][s]["seconds"] for r in ranks)
            row[s] = f"{t:.3f}"
            # CPU of all ranks per op, against the wall time: near the machine's cores, the ranks
            # are waiting for CPU, not for the network.
            cpu = sum(r["sizes"][s].get("cpu_seconds", 0.0) for r in ranks)
            row[f"{s}/cpu"] = f"{cpu:.3f} ({cpu / t:.1f} cores)"
            for base in ("ring", "gloo"):
                if base in results:
                    ref = max(r["sizes"][s]["seconds"] for r in results[base])
                    row[f"{s}/{base}"] = f"{t / ref:.2f}"
                else:
                    row[f"{s}/{base}"] = "-"
        rows.append(row)
    columns = [("config", "config"), ("ran", "algorithms ran (allreduce)")]
    for s in sizes:
        columns += [(s, f"{int(s) >> 10} KiB s"), (f"{s}/ring", "/ ring"), (f"{s}/gloo", "/ gloo"),
                    (f"{s}/cpu", "CPU s/op, all ranks")]
    print(table(rows, columns))
    ring = results.get("ring")
    failures = []
    for name, ranks in results.items():
        if name in ("gloo", "auto-fp16") or ring is None:
            continue
        for s in sizes:
            shas = {r["sizes"][s]["sha"] for r in ranks} | {r["sizes"][s]["sha"] for r in ring}
            if len(shas) != 1:
                failures.append(f"{name} {s} B: not bit-identical to the flat ring")
    for r in results.get("auto-fp16", []):
        for s in sizes:
            bound = 16 * 2.0**-11 * r["sizes"][s]["scale"] * 2  # each of 16 partial sums rounded once, twice over
            if r["sizes"][s]["error"] > bound:
                failures.append(f"auto-fp16 {s} B: error {r['sizes'][s]['error']} past {bound}")
    if ring is not None and "auto" in results:
        for s, limit in ((str(64 << 10), 0.3), (str(64 << 20), 1.0)):
            if s in sizes:
                ratio = max(r["sizes"][s]["seconds"] for r in results["auto"]) / max(
                    r["sizes"][s]["seconds"] for r in ring)
                verdict = "ok" if ratio <= limit else "FAILS"
                print(f"auto / ring at {int(s) >> 10} KiB: {ratio:.2f} (<= {limit}: {verdict})")
    print("bit-identity and codec bounds:", "ok" if not failures else "; ".join(failures))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
