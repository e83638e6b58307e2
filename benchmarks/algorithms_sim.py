"""Every allreduce algorithm at up to 1,024 ranks, in virtual time (ringserve/testing/netsim.py).

Each cell runs the shipped collective (collectives.allreduce: the plan, the program, the executor,
the planes) on N simulated ranks whose links follow the alpha-beta model: ``--latency-ms`` one
way, ``--mbps`` per host, one rank per host. Before the timed call every rank measures its links
(dataplane/calibration.py), as a worker does once per view, and ``auto`` chooses by what it
measured. The times are the model's, not this machine's: a loaded 2-core machine gives the same
table as an idle one, only later. It prints, per (N, size), each algorithm's completion time and
bytes sent per rank (as a multiple of the size), and checks the issue's two bounds:

- 4 KiB under auto: within 2x of 2 log2(N) alpha;
- 64 MiB under auto: within 1.2x of the bandwidth bound 2 (N-1)/N S beta plus the chosen
  algorithm's latency term.

Large cells run scaled (netsim.Model.scale): each payload byte stands for ``scale`` bytes, so that
64 MiB over 1,024 ranks fits in memory; frames and their headers are as many as at full size.

    .venv/bin/python benchmarks/algorithms_sim.py                      # the full table (long)
    .venv/bin/python benchmarks/algorithms_sim.py --worlds 8,64 --out /tmp/sim.json
    .venv/bin/python benchmarks/algorithms_sim.py --table /tmp/sim.json     # its markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np

from ringserve import selection, topology
from ringserve.testing import netsim, vclock
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import algorithms, collectives

ALGORITHMS = ("ring", "halving_doubling", "recursive_doubling", "tree", "ring2d", "auto")
MiB = 1 << 20


def scale_for(world: int, nbytes: int) -> int:
    """Each payload byte stands for this many: about 64 float32 per rank's block, at least 1."""
    return max(1, nbytes // (world * 64 * 4))


def latency_term(algorithm: str, world: int, latency_s: float) -> float:
    """The algorithm's latency term (its sequential steps times alpha)."""
    p = topology.power_below(world)
    fold = 0 if p == world else 2
    if algorithm == "ring":
        return 2 * (world - 1) * latency_s
    if algorithm == "halving_doubling":
        return (2 * math.log2(p) + fold) * latency_s
    if algorithm == "recursive_doubling":
        return (math.log2(p) + fold) * latency_s
    if algorithm == "tree":
        return 2 * topology.tree_depth(world) * latency_s
    rows, cols = topology.grid(world)
    return 2 * (rows - 1 + cols - 1) * latency_s


def cell(world: int, nbytes: int, setting: str, latency_s: float, bytes_per_s: float) -> dict[str, Any]:
    scale = scale_for(world, nbytes)
    model = netsim.Model(latency_s=latency_s, bytes_per_s=bytes_per_s, scale=scale)
    x = np.ones(max(nbytes // 4 // scale, 1), dtype=np.float32)
    chunk = max(MiB // scale, 4)
    forced = {"recursive_doubling": "halving_doubling"}.get(setting, setting)
    chosen: list[str] = []

    async def call(session: Session, rank: int) -> np.ndarray:
        if setting == "recursive_doubling":  # the small-message form of halving_doubling, by itself
            buf = np.empty_like(x)
            descriptor = Descriptor("allreduce", dtype="float32", shape=x.shape, op="sum")
            await algorithms.allreduce(session, setting, x, buf, op="sum", name="x", chunk_bytes=chunk,
                                       descriptor=descriptor, timeout_s=1e6)
            out = buf
        else:
            out = await collectives.allreduce(session, x, op="sum", name="x", chunk_bytes=chunk, timeout_s=1e6)
        if rank == 0:
            chosen.extend(a for (op, a), n in session.counters.algorithms.items() if op == "allreduce" and n)
        return out

    async def main() -> netsim.Outcome:
        return await netsim.simulate(world, call, model, algorithm=forced)

    started = time.perf_counter()
    outcome = vclock.run(main())
    wall = time.perf_counter() - started
    assert all(float(o[0]) == world and float(o[-1]) == world for o in outcome.results), "a wrong sum"
    ran = chosen[0] if chosen else "ring"
    return {"world": world, "bytes": nbytes, "setting": setting, "algorithm": ran, "seconds": outcome.seconds,
            "sent_per_rank": max(outcome.sent) / nbytes, "scale": scale, "wall_s": wall,
            "links": None if outcome.links is None else [outcome.links.latency_s, outcome.links.seconds_per_byte]}


def judge(rows: list[dict[str, Any]], latency_s: float, bytes_per_s: float) -> list[str]:
    """The issue's bounds, for each auto cell at 4 KiB and 64 MiB."""
    lines = []
    for row in rows:
        if row["setting"] != "auto":
            continue
        n, s, t = row["world"], row["bytes"], row["seconds"]
        if s == 4096:
            bound = 2 * 2 * math.log2(n) * latency_s
            lines.append(f"N={n} 4 KiB auto ({row['algorithm']}): {t:.3f} s = {t / (bound / 2):.2f} x 2 log2(N) alpha "
                         f"({'ok' if t <= bound else 'FAILS'}: within 2x)")
        if s == 64 * MiB:
            bound = 2 * (n - 1) / n * s / bytes_per_s + latency_term(row["algorithm"], n, latency_s)
            lines.append(f"N={n} 64 MiB auto ({row['algorithm']}): {t:.2f} s = {t / bound:.3f} x (bandwidth bound + "
                         f"its latency term, {bound:.2f} s) ({'ok' if t <= 1.2 * bound else 'FAILS'}: within 1.2x)")
    return lines


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of a run (as --out saves it): one row per (N, size), one column per setting, each
    cell the time in seconds and the bytes each rank sent, as a multiple of the size."""
    settings = [a for a in ALGORITHMS if any(r["setting"] == a for r in rows)]
    lines = ["| N | size | " + " | ".join(settings) + " |", "| --- | --- |" + " --- |" * len(settings)]
    cells: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["world"], row["bytes"]), {})[row["setting"]] = row
    for (world, nbytes), by in sorted(cells.items()):
        size = f"{nbytes >> 20} MiB" if nbytes >= MiB else f"{nbytes >> 10} KiB"
        texts = []
        for setting in settings:
            row = by.get(setting)
            if row is None:
                texts.append("-")
                continue
            ran = f" {row['algorithm']}" if setting == "auto" else ""
            texts.append(f"{row['seconds']:.3f} s ({row['sent_per_rank']:.2f} S){ran}")
        lines.append(f"| {world} | {size} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,64,256,1024")
    parser.add_argument("--sizes", default=f"4096,{MiB},{64 * MiB}")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--out", default="")
    parser.add_argument("--table", default="", help="print the markdown table of a run saved by --out, and stop")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print(markdown(saved["rows"]))
        for line in judge(saved["rows"], saved["latency_s"], saved["bytes_per_s"]):
            print(line)
        return
    latency_s, bytes_per_s = args.latency_ms / 1e3, args.mbps * 1e6 / 8
    rows: list[dict[str, Any]] = []
    print(f"alpha = {args.latency_ms:g} ms, beta = 1 / {args.mbps:g} Mbit/s; time (bytes sent per rank / size)",
          flush=True)
    for world in map(int, args.worlds.split(",")):
        for nbytes in map(int, args.sizes.split(",")):
            for setting in args.algorithms.split(","):
                if setting == "ring2d" and topology.grid(world)[0] < 2:
                    continue
                row = cell(world, nbytes, setting, latency_s, bytes_per_s)
                rows.append(row)
                model = selection.predict(row["algorithm"], nbytes, world, selection.LinkCosts.of(latency_s, bytes_per_s),
                                          MiB).seconds
                print(f"N={world:5d} {nbytes:>9d} B {setting:18s} ran {row['algorithm']:18s} {row['seconds']:9.3f} s "
                      f"({row['sent_per_rank']:.3f} S)  model {model:8.3f} s  [{row['wall_s']:.0f} s wall]", flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"latency_s": latency_s, "bytes_per_s": bytes_per_s, "rows": rows}, f, indent=1)
    for line in judge(rows, latency_s, bytes_per_s):
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
