"""Charts from the benchmarks' JSON: what docs/benchmarks/ shows beside its tables.

    python benchmarks/plots.py                                  # benchmarks/results -> docs/benchmarks/charts
    python benchmarks/plots.py --results DIR --out DIR

Reads what the benchmarks wrote with ``--json`` (see _results.py) and draws, as SVG:

- ``allreduce-busbw.svg`` (allreduce.py): bus bandwidth against size, one panel per world, for
  ringserve through shared memory, ringserve stream-only, gloo, and any other ringserve lane the
  JSON has a ``*_ms`` column for (the payload lane once it lands);
- ``training-step.svg`` (training_step.py): step time and CPU time per step against world size for
  each configuration, with one process alone at world 1;
- ``wan.svg`` (wan.py): the WAN step time of each configuration;
- ``wan-target.svg`` (wan.py --to-target): each configuration's time to the target loss;
- ``scale-sim.svg`` (scale_sim.py --json, kept as scale/scale-sim.json): the scale harness's real
  time per allreduce against the simulator's, by N;
- ``failover-<name>.svg`` (the chaos tests, CHAOS_TIMELINE_DIR): the job's committed step over time,
  and each worker process's life, with the faults marked.

Each chart's subtitle gives its run's date, the machine and the load average at the end of the
run, so that a chart is never read without the conditions it was measured in. A file that is
missing is skipped with a note; what is drawn is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import statistics
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): no display is needed

ROOT = pathlib.Path(__file__).resolve().parent.parent
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
# allreduce.py's time columns: which lane each one measured. A *_ms column not named here (a new
# lane) is drawn too, under its column name.
LANES = {"rs_ms": "ringserve, shared memory", "lane_ms": "ringserve, TCP payload lane",
         "stream_ms": "ringserve, stream only", "gloo_ms": "gloo"}
SKIP_COLUMNS = {"tls_ms"}
STYLE = {"ringserve, shared memory": ("#1565c0", "o"), "ringserve, stream only": ("#43a047", "s"),
         "ringserve, TCP payload lane": ("#6a1b9a", "D"),
         "gloo": ("#e65100", "^")}


def subtitle(record: dict[str, Any]) -> str:
    """The run's date, machine and load, for a chart's subtitle."""
    m = record.get("machine", {})
    load = m.get("load_average")
    load_text = f"load average {load[0]:g} (5 min {load[1]:g})" if load else "load not recorded"
    cpu = f" {m['cpu']}" if m.get("cpu") else ""
    memory = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    return f"{record.get('date', '?')[:16].replace('T', ' ')} UTC; {m.get('cores', '?')} cores{cpu}{memory}; {load_text}"


def size_bytes(text: str) -> int:
    """'64 KiB' -> 65536."""
    number, unit = text.split()
    return int(float(number) * UNITS[unit])


def number(value: object) -> float:
    """A table cell as a float ('1.57', '2.40x', '49%'); NaN for '-' or 'stalled'."""
    match = re.match(r"^\s*(-?[0-9.]+)", str(value))
    return float(match.group(1)) if match else math.nan


def _save(fig: Any, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def allreduce_chart(record: dict[str, Any], out: pathlib.Path) -> None:
    """Bus bandwidth against size, one panel per world."""
    rows = record["rows"]
    worlds = sorted({int(r["world"]) for r in rows})
    lanes = dict(LANES)
    for key in rows[0]:
        if key.endswith("_ms") and key not in lanes and key not in SKIP_COLUMNS:
            lanes[key] = f"ringserve, {key[:-3].replace('_', ' ')}"
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.2 * len(worlds), 4.2), sharey=True, squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        mine = [r for r in rows if int(r["world"]) == world]
        sizes = [size_bytes(r["size"]) for r in mine]
        factor = 2 * (world - 1) / world
        for key, label in lanes.items():
            ms = [number(r.get(key, "-")) for r in mine]
            if all(math.isnan(v) for v in ms):
                continue
            busbw = [s / (t / 1e3) * factor / 1e9 if t > 0 else math.nan for s, t in zip(sizes, ms, strict=True)]
            color, marker = STYLE.get(label, (None, "D"))
            ax.plot(sizes, busbw, marker=marker, color=color, label=label, linewidth=1.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [r["size"] for r in mine])
        ax.set_title(f"world {world}")
        ax.set_xlabel("allreduce size (float32)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth, GB/s (higher is better)")
    axes[0][-1].legend(loc="upper left", fontsize=9)
    fig.suptitle("Allreduce on loopback: ringserve and gloo in the same run", fontsize=12)
    fig.text(0.5, -0.02, subtitle(record), ha="center", fontsize=8, color="#555555")
    _save(fig, out / "allreduce-busbw.svg")


def training_chart(record: dict[str, Any], out: pathlib.Path) -> None:
    """Step time, and CPU time per step, against world size: one line per configuration."""
    rows = record["rows"]
    runs = list(dict.fromkeys(r["run"] for r in rows))
    alone = record.get("alone_ms")
    colors = ["#e65100", "#1565c0", "#43a047", "#6a1b9a", "#00838f"]
    fig, (wall, cpu) = plt.subplots(1, 2, figsize=(11.5, 4.4))
    for i, run in enumerate(runs):
        mine = sorted((int(r["world"]), number(r["step"]), number(r["cpu"])) for r in rows if r["run"] == run)
        worlds, steps, cpus = [w for w, _, _ in mine], [s for _, s, _ in mine], [c for _, _, c in mine]
        color = colors[i % len(colors)]
        wall.plot([1, *worlds] if alone else worlds, [alone, *steps] if alone else steps, marker="o", color=color,
                  label=run, linewidth=1.8)
        cpu.plot(worlds, cpus, marker="o", color=color, label=run, linewidth=1.8)
    all_worlds = sorted({int(r["world"]) for r in rows})
    wall.set_xticks(sorted({*all_worlds, *([1] if alone else [])}))
    wall.set_xlabel("world size (workers on one host)" + ("; 1: one process alone" if alone else ""))
    wall.set_ylabel("step time, ms, slowest rank (lower is better)")
    cpu.set_xticks(all_worlds)
    cpu.set_xlabel("world size (workers on one host)")
    cpu.set_ylabel("CPU ms per step, all ranks together")
    for ax in (wall, cpu):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    wall.set_title("wall time", fontsize=10)
    cpu.set_title("CPU time (moves much less with the machine's load)", fontsize=10)
    wall.legend(fontsize=8)
    fig.suptitle("Training step (MLP 784-2048-2048-10, batch 64 per worker): DDP over gloo and ringserve", fontsize=11)
    fig.text(0.5, -0.02, subtitle(record), ha="center", fontsize=8, color="#555555")
    _save(fig, out / "training-step.svg")


def wan_chart(record: dict[str, Any], out: pathlib.Path) -> None:
    """The WAN step time of each configuration, as bars."""
    rows = record["rows"]
    labels = [r["config"] for r in rows]
    steps = [number(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7.6, 0.45 * len(rows) + 1.6))
    colors = ["#1565c0" if label.startswith("ringserve") else "#e65100" for label in labels]
    finite = [0.0 if math.isnan(s) else s for s in steps]
    ax.barh(range(len(rows)), finite, color=colors)
    top = max(finite) if any(finite) else 1.0
    for i, s in enumerate(steps):
        ax.text((0 if math.isnan(s) else s) + top * 0.01, i, "stalled" if math.isnan(s) else f"{s:.0f} ms",
                va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("step time, ms (lower is better); orange: DDP baselines, blue: ringserve")
    ax.set_xlim(0, top * 1.18)
    ax.grid(True, axis="x", alpha=0.3)
    where = (f"{record.get('hosts', '?')} hosts, {record.get('rate_mbit', '?'):g} Mbit/s uplinks, "
             f"{record.get('delay_ms', '?'):g} ms one way, MTU {record.get('mtu', '?')}")
    fig.suptitle(f"Training step over an emulated WAN: {where}", fontsize=11)
    fig.text(0.5, -0.02, subtitle(record), ha="center", fontsize=8, color="#555555")
    _save(fig, out / "wan.svg")


def wan_target_chart(record: dict[str, Any], out: pathlib.Path) -> None:
    """Seconds to the target loss of each configuration (wan.py --to-target), as bars."""
    rows = record["rows"]
    labels = [r["config"] for r in rows]
    times = [number(r["time"]) if str(r["time"])[:1].isdigit() else math.nan for r in rows]
    fig, ax = plt.subplots(figsize=(7.6, 0.45 * len(rows) + 1.6))
    colors = ["#6a1b9a" if label.startswith("DiLoCo") else "#1565c0" if label.startswith("ringserve") else "#e65100"
              for label in labels]
    finite = [0.0 if math.isnan(t) else t for t in times]
    ax.barh(range(len(rows)), finite, color=colors)
    top = max(finite) if any(finite) else 1.0
    for i, (t, r) in enumerate(zip(times, rows, strict=True)):
        text = (f"{t:.0f} s" + (f" ({r['ratio']}x fp16 hook)" if r.get("ratio", "-") != "-" else "")
                if not math.isnan(t) else str(r["time"])[:40])
        ax.text((0 if math.isnan(t) else t) + top * 0.01, i, text, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to the target loss (lower is better); orange: DDP, blue: ringserve every step, purple: DiLoCo")
    ax.set_xlim(0, top * 1.45)
    ax.grid(True, axis="x", alpha=0.3)
    target = record.get("target_loss")
    fig.suptitle(f"Time to a target loss over an emulated WAN ({record.get('hosts', '?')} hosts, "
                 f"{record.get('rate_mbit', '?'):g} Mbit/s, {record.get('delay_ms', '?'):g} ms one way)"
                 + (f"; target {target:.4f}" if isinstance(target, float) else ""), fontsize=10)
    fig.text(0.5, -0.02, subtitle(record), ha="center", fontsize=8, color="#555555")
    _save(fig, out / "wan-target.svg")


def failover_chart(record: dict[str, Any], out: pathlib.Path, stem: str) -> None:
    """The job's committed step over time, and each worker process's life, the faults marked."""
    commits = record["commits"]
    faults = record["faults"]
    pids = sorted({c["pid"] for c in commits} | {f["pid"] for f in faults},
                  key=lambda pid: min([c["time"] for c in commits if c["pid"] == pid]
                                      + [f["time"] for f in faults if f["pid"] == pid]))
    fig, (steps, lives) = plt.subplots(2, 1, figsize=(8.6, 2.6 + 0.22 * len(pids) + 2.4), sharex=True,
                                       gridspec_kw={"height_ratios": [2.4, 0.6 + 0.22 * len(pids)]})
    by_time = sorted(commits, key=lambda c: c["time"])
    top: list[tuple[float, int]] = []
    for c in by_time:  # the furthest step committed by anyone so far: the job's progress
        top.append((c["time"], max(c["step"], top[-1][1] if top else 0)))
    steps.plot([x for x, _ in top], [s for _, s in top], color="#1565c0", linewidth=1.6, label="furthest committed step")
    for j, fault in enumerate(faults):
        for ax in (steps, lives):
            ax.axvline(fault["time"], color="#c62828", linewidth=0.8, alpha=0.6,
                       label=fault["kind"] if (j == 0 and ax is steps) else None)
    steps.set_ylabel("committed step")
    steps.grid(True, alpha=0.3)
    steps.legend(loc="upper left", fontsize=8)
    for row, pid in enumerate(pids):
        mine = [c["time"] for c in commits if c["pid"] == pid]
        if mine:
            lives.plot([min(mine), max(mine)], [row, row], color="#43a047", linewidth=5, solid_capstyle="butt")
        for fault in faults:
            if fault["pid"] == pid:
                lives.plot([fault["time"]], [row], marker="x", color="#c62828", markersize=8, mew=2)
    lives.set_yticks(range(len(pids)), [f"process {i + 1}" for i in range(len(pids))], fontsize=7)
    lives.invert_yaxis()
    lives.set_ylabel("workers")
    recovery = record.get("recovery_s") or []
    summary = (f"{len(faults)} faults; from each to the next view's first commit: median "
               f"{statistics.median(recovery):.2f} s, max {max(recovery):.2f} s" if recovery else "")
    lives.set_xlabel("seconds since the launch; green: a worker process from its first commit to its last, "
                     "x: killed" + (f"\n{summary}" if summary else ""), fontsize=9)
    lives.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"Failover: {record['name']}, a world of 4 with restarts (chaos test)", fontsize=11)
    fig.text(0.5, -0.02, subtitle(record), ha="center", fontsize=8, color="#555555")
    _save(fig, out / f"failover-{stem}.svg")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "benchmarks" / "charts")
    args = p.parse_args()
    plt.rcParams["svg.hashsalt"] = "ringserve"  # stable ids: the same JSON draws the same SVG
    drawers = {"allreduce.json": allreduce_chart, "training_step.json": training_chart, "wan.json": wan_chart,
               "wan_target.json": wan_target_chart}
    drawn = 0
    for name, draw in drawers.items():
        path = args.results / name
        if not path.exists():
            print(f"skipped {name}: {path} does not exist")
            continue
        draw(json.loads(path.read_text()), args.out)
        drawn += 1
    simulated = args.results / "scale" / "scale-sim.json"
    if simulated.exists():
        import scale_sim  # here: it loads the simulator, which the other charts do not need

        record = json.loads(simulated.read_text())
        workers = [f["workers"] for f in record.get("fits", {}).values()]
        calibrated = scale_sim.calibrated_on(workers) if workers else pathlib.Path(record["calibration"]).stem
        scale_sim.chart(record["rows"], str(args.out / "scale-sim.svg"), calibrated)
        drawn += 1
    for path in sorted((args.results / "failover").glob("*.json")):
        failover_chart(json.loads(path.read_text()), args.out, path.stem)
        drawn += 1
    if not drawn:
        sys.exit(f"plots.py: no results in {args.results}")


if __name__ == "__main__":
    main()
