"""allreduce.py's ``--algorithms`` run: ringserve under several settings of RINGSERVE_ALGORITHM
(``auto`` against the ``ring``, say) in the same run, interleaved, on one host or between hosts,
with one or several ranks per host. See allreduce.py's docstring for what is measured; this is the
driver.

Only paired ratios mean anything on a machine shared with other work: each round runs every
setting once, one after the other, in an order rotated each round, with fresh processes, and a
cell's ratio is the median [range] over the rounds of one setting's time over the other's in the
same round. The load average at each round's start is reported with them. Beside it, the ratio
of the best times over the rounds: load only adds time, so under heavy load (the ratios of two
identical plans ranged 0.2 to 2.7 at a load average of 15 on 2 cores) the best of many rounds is
the steadier figure of what each plan costs.

A named algorithm runs flat (RINGSERVE_HIERARCHICAL=0): with several ranks per host, ``ring`` is
the flat ring, the one every rank can fall back to; ``auto`` chooses by host or flat itself.

Hosts: on one host (``--between-hosts`` off) every rank is on this machine, with shared memory;
``--per-host L`` names each group of L consecutive ranks a host of its own (RINGSERVE_HOSTNAME),
which changes only what the planner sees (they still share memory). Between hosts, each host is a
network namespace on a veth bridge (_veth.py); with one rank a host shared memory is off (the
namespaces share a kernel), as in _between.py; with several, a host's ranks share a PID namespace
of their own (``unshare --pid``), so that they pass payloads through shared memory and ranks of two
hosts cannot: between hosts every byte crosses the bridge.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

from _common import OPEN_COORDINATOR, PYTHON, read_json, stop, table, wait_all
from _results import save
from _veth import DEVICE, Lan, free_port

ME = str(pathlib.Path(__file__).resolve().parent / "allreduce.py")
# A worker starved of CPU by the others on 2 cores must not be taken for dead mid-run: what is
# timed is the data plane, and a view change would time nothing.
HEARTBEAT_TIMEOUT_S = 60.0


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f} - {max(values):.2f}]"


def settings(algorithm: str) -> dict[str, str]:
    """The environment of a run under ``algorithm``: a named one flat, ``auto`` as it comes."""
    env = {"RINGSERVE_ALGORITHM": algorithm}
    if algorithm != "auto":
        env["RINGSERVE_HIERARCHICAL"] = "0"
    return env


@contextlib.contextmanager
def _coordinator(argv_prefix: Sequence[str], address: str, world: int, lan: Lan | None) -> Iterator[str]:
    """A coordinator for ``world`` workers at ``address`` (in host 0's namespace between hosts)."""
    port = free_port()
    argv = [PYTHON, "-m", "ringserve.cli", "coordinator", "--host", address, "--port", str(port),
            "--min-workers", str(world), "--max-workers", str(world), "--settle-seconds", "0.1",
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
    proc = subprocess.Popen([*argv_prefix, *argv], env={**os.environ, **OPEN_COORDINATOR})
    try:
        if lan is not None:
            lan.wait_listening(lan.hosts[0], port, timeout_s=60)
        else:
            _wait_local(address, port, 60)
        yield f"{address}:{port}"
    finally:
        stop(proc)


def _wait_local(address: str, port: int, timeout_s: float) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {address}:{port} after {timeout_s} s") from None
            time.sleep(0.1)


def _rank_argv(world: int, sizes: Sequence[str], out: pathlib.Path, rank: int) -> list[str]:
    return [PYTHON, ME, "--role", "ringserve", "--world", str(world), "--out", f"{out}.{rank}.json", "--sizes", *sizes]


def run_one_host(world: int, per_host: int, sizes: Sequence[str], out: pathlib.Path, algorithm: str) -> None:
    """One run of ``world`` ranks on this machine under ``algorithm``."""
    with _coordinator([], "127.0.0.1", world, None) as address:
        env = {**os.environ, "RINGSERVE_COORDINATOR": address, **settings(algorithm)}
        named = per_host > 1  # else the machine's own name: one host
        procs = [subprocess.Popen(_rank_argv(world, sizes, out, r),
                                  env={**env, "RINGSERVE_RANK_HINT": str(r),
                                       **({"RINGSERVE_HOSTNAME": f"h{r // per_host}"} if named else {})})
                 for r in range(world)]
        wait_all(procs, 900)


def run_between(lan: Lan, per_host: int, sizes: Sequence[str], out: pathlib.Path, algorithm: str) -> None:
    """One run of ``per_host`` ranks on each of ``lan``'s hosts under ``algorithm``."""
    world = len(lan.hosts) * per_host
    host0 = lan.hosts[0]
    with _coordinator(lan.command(host0, []), host0.address, world, lan) as address:
        procs = []
        for h in lan.hosts:
            env = {"RINGSERVE_COORDINATOR": address, "RINGSERVE_BIND_HOST": h.address,
                   "RINGSERVE_HOSTNAME": f"h{h.index}", "RINGSERVE_PAYLOAD_LANE": "tcp",
                   "GLOO_SOCKET_IFNAME": DEVICE, "OMP_NUM_THREADS": "1", **settings(algorithm)}
            ranks = range(h.index * per_host, (h.index + 1) * per_host)
            if per_host == 1:
                env["RINGSERVE_SHARED_MEMORY"] = "0"
                argv = _rank_argv(world, sizes, out, h.index)
                env["RINGSERVE_RANK_HINT"] = str(h.index)
            else:
                argv = ["unshare", "--pid", "--fork", "--mount-proc", PYTHON, ME, "--role", "host",
                        "--ranks", ",".join(map(str, ranks)), "--world", str(world), "--out", str(out),
                        "--sizes", *sizes]
            procs.append(subprocess.Popen(lan.command(h, argv, env)))
        wait_all(procs, 900)


def host(args: argparse.Namespace) -> None:
    """One host's ranks, started together inside its PID namespace (role ``host``)."""
    sizes = [str(s) for s in args.sizes]
    procs = [subprocess.Popen(_rank_argv(args.world, sizes, pathlib.Path(args.out), r),
                              env={**os.environ, "RINGSERVE_RANK_HINT": str(r)})
             for r in map(int, args.ranks.split(","))]
    wait_all(procs, 900)


def _slowest(out: pathlib.Path, world: int, size: int) -> float:
    return max(read_json(pathlib.Path(f"{out}.{i}.json"))[str(size)]["t"] for i in range(world))


def _ran(out: pathlib.Path, world: int, size: int) -> set[str]:
    """The algorithms the ranks' timed allreduces of ``size`` ran, all ranks together."""
    return {a for i in range(world) for a in read_json(pathlib.Path(f"{out}.{i}.json"))[str(size)].get("algorithms", {})}


def planned(size: int, world: int, per_host: int, *, named: bool) -> str:
    """What ``auto`` plans for an allreduce of ``size`` bytes of float32 over ``world`` ranks,
    ``per_host`` a host (``named``: hosts the view tells apart; else all on one), by the figures of
    the links' class, as every rank plans it (worker/ops/planner.py): the counters name a by-host
    allreduce by its stages' algorithm only."""
    from ringserve import selection
    from ringserve.config import WorkerConfig
    from ringserve.worker.ops import planner

    hosts = tuple(r // per_host for r in range(world)) if named else (0,) * world
    figures = selection.planned(selection.Measured(50e-6, 1e-9), hosts=hosts, n=world)
    ground = planner.Ground(world, 0, hosts, selection.AUTO, "auto")
    plan = planner.plan(planner.Call("allreduce", size // 4, 4, size), ground, figures, WorkerConfig().chunk_bytes)
    if plan.algorithm == planner.BY_HOST:
        return "by host: " + ", ".join(stage.algorithm for stage in plan.stages)
    return plan.algorithm


def main(args: argparse.Namespace) -> None:
    algorithms: list[str] = args.algorithms
    sizes: list[int] = args.sizes
    size_args = [str(s) for s in sizes]
    per_host: int = args.per_host
    base = "ring" if "ring" in algorithms else algorithms[-1]
    rows: list[dict[str, object]] = []
    load: list[float] = []
    raw: dict[int, dict[str, list[dict[int, float]]]] = {}  # world: setting: each round's time by size
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        for world in args.worlds:
            if world % per_host:
                raise SystemExit(f"The world ({world}) is not a whole number of hosts of {per_host} ranks.")
            times: dict[str, list[dict[int, float]]] = {a: [] for a in algorithms}
            raw[world] = times
            ran: dict[str, dict[int, set[str]]] = {a: {s: set() for s in sizes} for a in algorithms}
            with Lan(world // per_host) if args.between_hosts else contextlib.nullcontext() as lan:
                for r in range(args.rounds):
                    load.append(os.getloadavg()[0])
                    for algorithm in algorithms[r % len(algorithms):] + algorithms[: r % len(algorithms)]:
                        out = tmp / f"{algorithm}-{world}-{r}"
                        if lan is None:
                            run_one_host(world, per_host, size_args, out, algorithm)
                        else:
                            run_between(lan, per_host, size_args, out, algorithm)
                        times[algorithm].append({s: _slowest(out, world, s) for s in sizes})
                        for s in sizes:
                            ran[algorithm][s] |= _ran(out, world, s)
                    print(f"world {world}, round {r + 1}/{args.rounds} done (load {load[-1]:.2f})", flush=True)
            for s in sizes:
                hosts = f"{world // per_host} x {per_host}" if args.between_hosts or per_host > 1 else "1 (all)"
                row: dict[str, object] = {"world": world, "hosts": hosts, "size": _label(s),
                                          "plan": planned(s, world, per_host, named=args.between_hosts or per_host > 1)}
                for a in algorithms:
                    row[f"{a}_ms"] = f"{statistics.median(t[s] for t in times[a]) * 1e3:.2f}"
                    row[f"{a}_ran"] = ", ".join(sorted(ran[a][s]))
                    if a != base:
                        row[f"{a}_ratio"] = _spread([t[s] / b[s] for t, b in zip(times[a], times[base], strict=True)])
                        row[f"{a}_best"] = f"{min(t[s] for t in times[a]) / min(b[s] for b in times[base]):.2f}"
                rows.append(row)
    columns = [("world", "world"), ("hosts", "hosts x ranks each"), ("size", "size")]
    for a in algorithms:
        columns.append((f"{a}_ms", f"{a} ms/op"))
    for a in algorithms:
        if a != base:
            columns.append((f"{a}_ratio", f"{a} / {base}, median [range]"))
            columns.append((f"{a}_best", f"{a} / {base}, best of rounds"))
    for a in algorithms:
        if a != "ring":
            columns.append((f"{a}_ran", f"{a} ran (counters)"))
    if "auto" in algorithms:
        columns.append(("plan", "auto's plan (planner)"))
    where = ("between hosts (a network namespace per host, veth, no rate limit)" if args.between_hosts
             else "on one host (shared memory)")
    print(f"\nallreduce of float32 sums {where}, {per_host} rank(s) a host, {args.rounds} interleaved rounds; "
          f"load average at the rounds' starts: {min(load):.2f} - {max(load):.2f}")
    print(table(rows, columns))
    if args.json:
        save(args.json, "allreduce-algorithms", rows, between_hosts=args.between_hosts, per_host=per_host,
             rounds=args.rounds, load=load, seconds=raw)
