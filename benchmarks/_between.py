"""allreduce.py's ``--between-hosts`` run: every rank a host of its own (a network namespace on a
veth bridge, _veth.py), gloo and ringserve with and without its TCP payload lane, in interleaved
rounds. See allreduce.py's docstring for what is measured; this is the driver."""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import tempfile
from collections.abc import Sequence

from _common import OPEN_COORDINATOR, PYTHON, read_json, stop, table, wait_all
from _veth import DEVICE, SUBNET, Lan, free_port

ME = str(pathlib.Path(__file__).resolve().parent / "allreduce.py")
KINDS = ("gloo", "lane", "stream")


def _run(lan: Lan, argvs: Sequence[Sequence[str]], env: dict[str, str], timeout_s: float) -> None:
    """Runs one process per host (argvs[i] in host i's namespace); raises if any fails."""
    procs = [subprocess.Popen(lan.command(h, argv, {**env, "RINGSERVE_RANK_HINT": str(h.index),
                                                    "RINGSERVE_BIND_HOST": h.address, "RINGSERVE_HOSTNAME": f"h{h.index}",
                                                    "GLOO_SOCKET_IFNAME": DEVICE, "OMP_NUM_THREADS": "1"}))
             for h, argv in zip(lan.hosts, argvs, strict=True)]
    wait_all(procs, timeout_s)


def _ringserve(lan: Lan, world: int, sizes: list[str], out: pathlib.Path, lane: str, security: dict[str, object]) -> None:
    host0, port = lan.hosts[0], free_port()
    flags = []
    for key, value in security.items():
        if key == "token":
            token = out.parent / "token"
            token.write_text(str(value))
            flags += ["--token-file", str(token)]
        elif value is True:
            flags.append(f"--{key.replace('_', '-')}")
        else:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    # Without a token of the run's, an open coordinator by name: the namespaces are the benchmark's own.
    opened = {} if "token" in security or security.get("tls_require_client_auth") else OPEN_COORDINATOR
    coordinator = subprocess.Popen(lan.command(host0, [PYTHON, "-m", "ringserve.cli", "coordinator", "--host", host0.address,
                                                       "--port", str(port), "--min-workers", str(world),
                                                       "--max-workers", str(world), "--settle-seconds", "0.1", *flags],
                                               opened))
    try:
        lan.wait_listening(host0, port, timeout_s=60)
        env = {"RINGSERVE_COORDINATOR": f"{host0.address}:{port}", "RINGSERVE_SHARED_MEMORY": "0",
               "RINGSERVE_PAYLOAD_LANE": lane,
               **{f"RINGSERVE_{k.upper()}": str(int(v) if isinstance(v, bool) else v) for k, v in security.items()}}
        _run(lan, [[PYTHON, ME, "--role", "ringserve", "--world", str(world), "--out", f"{out}.{i}.json",
                    "--sizes", *sizes] for i in range(world)], env, timeout_s=900)
    finally:
        stop(coordinator)


def _gloo(lan: Lan, world: int, sizes: list[str], out: pathlib.Path) -> None:
    port = free_port()
    _run(lan, [[PYTHON, ME, "--role", "gloo", "--world", str(world), "--master", lan.hosts[0].address,
                "--port", str(port), "--out", f"{out}.{i}.json", "--sizes", *sizes] for i in range(world)],
         {}, timeout_s=900)


def _slowest(out: pathlib.Path, world: int, size: int) -> float:
    return max(read_json(pathlib.Path(f"{out}.{i}.json"))[str(size)]["t"] for i in range(world))


def _cpu(out: pathlib.Path, world: int, size: int) -> float:
    """CPU seconds per op, every rank together: what the ranks cost a shared machine."""
    return sum(read_json(pathlib.Path(f"{out}.{i}.json"))[str(size)]["cpu"] for i in range(world))


def _algorithms(out: pathlib.Path, size: int) -> set[str]:
    """The algorithms rank 0's timed allreduces of ``size`` ran (auto picks one per view and size)."""
    return set(read_json(pathlib.Path(f"{out}.0.json"))[str(size)].get("algorithms", {}))


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f} - {max(values):.2f}]"


def main(args: argparse.Namespace) -> None:
    from allreduce import tls_settings

    sizes: list[int] = args.sizes
    size_args = [str(s) for s in sizes]
    kinds = [k for k in KINDS if not (k == "gloo" and args.no_gloo) and not (k == "stream" and args.no_stream)]
    if args.tls:
        kinds.append("mtls")
        if not args.no_stream:
            kinds.append("mtls-stream")
    rows = []
    load = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        hosts = tuple(f"{SUBNET}.{i + 1}" for i in range(max(args.worlds)))
        security = tls_settings(tmp, hosts) if args.tls else {}
        for world in args.worlds:
            times: dict[str, list[dict[int, float]]] = {k: [] for k in kinds}
            cpus: dict[str, list[dict[int, float]]] = {k: [] for k in kinds}
            ran: dict[int, set[str]] = {s: set() for s in sizes}  # by the lane's runs
            with Lan(world) as lan:
                for r in range(args.rounds):
                    load.append(os.getloadavg()[0])
                    for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
                        out = tmp / f"{kind}-{world}-{r}"
                        if kind == "gloo":
                            _gloo(lan, world, size_args, out)
                        else:
                            _ringserve(lan, world, size_args, out, "off" if kind.endswith("stream") else "tcp",
                                       security if kind.startswith("mtls") else {})
                        times[kind].append({s: _slowest(out, world, s) for s in sizes})
                        cpus[kind].append({s: _cpu(out, world, s) for s in sizes})
                        if kind == "lane":
                            for s in sizes:
                                ran[s] |= _algorithms(out, s)
                    print(f"world {world}, round {r + 1}/{args.rounds} done (load {load[-1]:.2f})", flush=True)
            factor = 2 * (world - 1) / world
            for s in sizes:
                row: dict[str, object] = {"world": world, "size": _label(s)}
                for kind in kinds:
                    ts = [t[s] for t in times[kind]]
                    row[f"{kind}_ms"] = f"{statistics.median(ts) * 1e3:.2f}"
                    row[f"{kind}_bw"] = f"{factor * s / statistics.median(ts) / 1e9:.2f}"
                    row[f"{kind}_cpu"] = f"{statistics.median(c[s] for c in cpus[kind]) * 1e3:.1f}"
                    if "gloo" in times and kind != "gloo":
                        row[f"{kind}_ratio"] = _spread([g[s] / t[s] for g, t in zip(times["gloo"], times[kind], strict=True)])
                if "lane" in kinds:
                    row["lane_algorithms"] = ", ".join(sorted(ran[s]))
                if args.tls:
                    row["mtls_over_lane"] = _spread([m[s] / t[s] for m, t in zip(times["mtls"], times["lane"], strict=True)])
                if "mtls-stream" in times:
                    row["mtls_lane_over_stream"] = _spread(
                        [m[s] / t[s] for m, t in zip(times["mtls"], times["mtls-stream"], strict=True)])
                rows.append(row)
    columns = [("world", "world"), ("size", "size")]
    names = {"gloo": "gloo", "lane": "ringserve, lane", "stream": "ringserve, stream-only", "mtls": "ringserve, lane, mTLS",
             "mtls-stream": "ringserve, stream-only, mTLS"}
    for kind in kinds:
        columns.append((f"{kind}_ms", f"{names[kind]} ms/op"))
        columns.append((f"{kind}_bw", f"{names[kind]} busbw GB/s"))
        columns.append((f"{kind}_cpu", f"{names[kind]} CPU ms/op, all ranks"))
        if "gloo" in kinds and kind != "gloo":
            columns.append((f"{kind}_ratio", f"{names[kind]} busbw / gloo, median [range]"))
    if "lane" in kinds:
        columns.append(("lane_algorithms", "ringserve, lane: algorithms auto ran"))
    if args.tls:
        columns.append(("mtls_over_lane", "mTLS time / plaintext lane, median [range]"))
    if "mtls-stream" in kinds:
        columns.append(("mtls_lane_over_stream", "mTLS lane time / mTLS stream's, median [range]"))
    print(f"\nallreduce of float32 sums between hosts (a network namespace per rank, veth, no rate limit), "
          f"{args.rounds} interleaved rounds; load average at the rounds' starts: "
          f"{min(load):.2f} - {max(load):.2f}")
    print(table(rows, columns))
