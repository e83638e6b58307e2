"""The scale harness's allreduces (scale.py) against the simulator's prediction for the same job.

    .venv/bin/python benchmarks/scale_sim.py RUN [RUN ...] [--calibrate RUN [RUN]] [--chart F.svg] [--json F]
    .venv/bin/python benchmarks/scale_sim.py benchmarks/results/scale/scale-{16,32,64,128,256}.json \
        --calibrate benchmarks/results/scale/scale-{16,128}.json --chart docs/benchmarks/charts/scale-sim.svg

Each RUN is a result of scale.py (``--json``), or the directory of a run's event files
(``--workdir``; its steps in views of the largest world, all of them). For each, the simulator
(ringserve/testing/netsim.py) runs the workers' loop as scale_worker.py does, on the run's hosts
and ranks: per step, for each size, the vector is filled, allreduced under ``auto`` (the shipped
plan, programs, executor and planes, by host where the plan says) and checked; then the commit's
allreduce. It reports per size the median over steps of the slowest rank's time, as the harness
does, beside the run's, and their ratio.

**The model.** On a 2-core machine the workers of the harness are bound by the CPU they share,
not by the links (at 16 workers their CPU a step, over 2 cores, is already most of the step). So
the network (``--latency-us``, ``--gbps`` between hosts, shared memory within one: the veth's own
cost is the kernel's CPU, counted in the bytes' CPU) sits under a machine of ``cores`` cores
(netsim.Cpu) that every worker shares: each frame costs its sender and its receiver ``frame_s``
of CPU plus ``byte_s`` a byte, each call ``call_s``, filling and checking a vector what the run
measured, each worker runs on one core at a time, and work queues for the first core free.

**The calibration.** ``call_s``, ``frame_s`` and ``byte_s`` come from one run (``--calibrate``,
by default the smallest run given that recorded its CPU): the median CPU seconds of a worker over
an allreduce of each of its three sizes (the process's CPU, all threads, user and system:
independent of what else the machine runs), against the frames and bytes the simulated worker
sends and takes in that allreduce, at that run's N: three equations, three unknowns. Filling and
checking cost their measured CPU a byte. The CPU per call grows with the number of processes on
the machine (cache, context switches, more streams a worker): given two calibration runs, each
figure is calibrated at both and carried to any other N as a power law through the two (Growth).
Everything else, and every time, is predicted: at the calibration runs' N as at the others. Where
a run measured the CPU that the machine's other processes used meanwhile (scale.py's
``machine_cpu`` less ``workers_cpu``), the cores are that much slower for its workers. Which class of links ``auto`` planned by (a LAN, or, where
a loaded machine's measure of the links read 8 ms or more one way, a WAN: selection.planned) is
read from what the run's calls ran.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import pathlib
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringserve import config, selection
from ringserve.testing import netsim, vclock
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives, planner

CHUNK = config.WorkerConfig().chunk_bytes
# What auto plans by, per class of measured links (selection.planned takes a Measured by its class).
CLASSES = {"lan": selection.Measured(100e-6, 1e-9), "wan": selection.Measured(20e-3, 1e-8)}
COMMIT = "commit"


@dataclass
class Run:
    """What the simulation needs of a real run, and what it measured."""

    source: str
    workers: int
    hosts: tuple[int, ...]  # each rank's host
    sizes: list[int]
    slowest_s: dict[int, float]  # per size: the median over steps of the slowest rank's time
    median_s: dict[int, float] = field(default_factory=dict)  # per size: the median of every rank's time
    cpu: dict[str, dict[int, float]] = field(default_factory=dict)  # cpu, fill_cpu, check_cpu: per size
    ran: dict[int, dict[str, int]] = field(default_factory=dict)  # per size: rank-calls per set of algorithms
    algorithms: dict[str, int] = field(default_factory=dict)  # every algorithm the run's calls ran
    load: float = float("nan")
    cores: int = 0
    links: str = ""  # the class auto planned by, where it is given (--links), not read from what ran
    others_cpu: float = 0.0  # the cores that the machine's other processes used meanwhile (the coordinator's too)


def placement(workers: int, hosts: int) -> tuple[int, ...]:
    """scale.py's: worker i on host i // (workers / hosts), the coordinator on a host of its own;
    the ranks of the first view follow the workers' order (RINGSERVE_RANK_HINT)."""
    per = workers // hosts
    return tuple(i // per for i in range(workers))


def from_json(path: pathlib.Path) -> Run:
    r = json.loads(path.read_text())
    ops = {int(k): v for k, v in r["ops"].items() if k != COMMIT}
    run = Run(str(path), r["workers"], tuple(r.get("placement") or placement(r["workers"], r["hosts"])),
              list(r["sizes"]), {s: o["slowest_s"] for s, o in ops.items()}, {s: o["median_s"] for s, o in ops.items()},
              algorithms=r.get("algorithms", {}),
              load=r.get("load", float("nan")), cores=r.get("cores") or 0)
    steady = r.get("steady", {})
    if "machine_cpu" in steady:
        run.others_cpu = max(0.0, steady["machine_cpu"] - steady["workers_cpu"])
    for key in ("cpu", "fill_cpu", "check_cpu"):
        if all(f"{key}_s" in o for o in ops.values()):
            run.cpu[key] = {s: o[f"{key}_s"] for s, o in ops.items()}
    run.ran = {s: o["ran"] for s, o in ops.items() if "ran" in o}
    return run


def from_workdir(path: pathlib.Path) -> Run:
    """A run without its JSON (one that did not finish): every step of a view of its largest world."""
    events: list[dict[str, Any]] = []
    for name in glob.glob(str(path / "worker-*.jsonl")):
        with open(name) as f:
            events.extend(json.loads(line) for line in f if line.endswith("}\n"))
    workers = max(e["world"] for e in events if e["kind"] == "op")
    hosts = len(glob.glob(str(path / "boot-*")))
    by: dict[tuple[int, int, int], list[float]] = {}
    algorithms: dict[str, int] = {}
    for e in events:
        if e["kind"] == "op" and e["world"] == workers:
            by.setdefault((e["size"], e["view"], e["step"]), []).append(e["seconds"])
        if e["kind"] == "end":
            for name, n in e["algorithms"].items():
                algorithms[name] = algorithms.get(name, 0) + n
    sizes = sorted({s for s, _, _ in by})
    full = {s: [ts for (z, _, _), ts in by.items() if z == s and len(ts) == workers] for s in sizes}
    slowest = {s: statistics.median(max(ts) for ts in full[s]) for s in sizes}
    median = {s: statistics.median(t for ts in full[s] for t in ts) for s in sizes}
    return Run(str(path), workers, placement(workers, hosts), sizes, slowest, median, algorithms=algorithms)


def load(path: str) -> Run:
    p = pathlib.Path(path)
    return from_workdir(p) if p.is_dir() else from_json(p)


def planned_names(run: Run, cls: str, nbytes: int) -> str:
    """The algorithms auto runs for an allreduce of ``nbytes`` on the run's ranks by ``cls``'s
    figures, as the worker's counters name them (a plan by host counts each stage's)."""
    ground = planner.Ground(run.workers, 0, run.hosts, selection.AUTO, "auto")
    plan = planner.plan(planner.Call("allreduce", nbytes // 4, 4, nbytes), ground, CLASSES[cls], CHUNK)
    return "+".join(sorted({stage.algorithm for stage in plan.stages}))


def link_class(run: Run) -> str:
    """The class whose plans the run's calls ran: by each size's calls where it recorded them
    (the class most of them ran), else the class each of whose plans the run ran at all (a LAN
    where both plan alike, or where neither fits)."""
    if run.links:
        return run.links
    def fits(cls: str) -> int:
        if run.ran:
            return sum(ran.get(planned_names(run, cls, s), 0) for s, ran in run.ran.items())
        return all(name in run.algorithms for s in run.sizes for name in planned_names(run, cls, s).split("+"))
    return max(CLASSES, key=lambda cls: (fits(cls), cls == "lan"))


@dataclass(frozen=True)
class Figures:
    """The model's figures: the links, the cores and their costs, and the loop's own CPU."""

    cpu: netsim.Cpu
    call_s: float
    fill_s: float  # a byte
    check_s: float  # a byte
    latency_s: float
    bytes_per_s: float


# The figures that grow with the number of processes on the machine (Growth), with where each lives.
GROWING = ("call_s", "frame_s", "byte_s", "fill_s", "check_s")


def _figure(figures: Figures, name: str) -> float:
    return getattr(figures.cpu, name) if name in ("frame_s", "byte_s") else getattr(figures, name)


@dataclass(frozen=True)
class Growth:
    """The CPU figures as a function of the number of workers N on the machine: each figure f
    calibrated at two runs (N = a and b) and carried as a power law, f(N) = f(a) (N / a)^k with
    k = log(f(b) / f(a)) / log(b / a). One run alone: the figures do not grow (every k is 0)."""

    at_n: int
    figures: Figures
    exponents: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, fitted: list[tuple[int, Figures]]) -> Growth:
        (a, fa), *rest = sorted(fitted, key=lambda x: x[0])
        if not rest:
            return cls(a, fa)
        (b, fb), = rest
        if b == a:
            raise SystemExit(f"The two calibration runs have the same N ({a}): growth with N needs two.")
        return cls(a, fa, {name: float(np.log(_figure(fb, name) / _figure(fa, name)) / np.log(b / a))
                           for name in GROWING})

    def at(self, n: int) -> Figures:
        k = {name: (n / self.at_n) ** self.exponents.get(name, 0.0) for name in GROWING}
        f = self.figures
        cpu = netsim.Cpu(f.cpu.cores, f.cpu.frame_s * k["frame_s"], f.cpu.byte_s * k["byte_s"], f.cpu.handoffs)
        return Figures(cpu, f.call_s * k["call_s"], f.fill_s * k["fill_s"], f.check_s * k["check_s"], f.latency_s,
                       f.bytes_per_s)


def scale_for(sizes: list[int]) -> int:
    """Each payload byte stands for this many: the smallest size keeps 64 float32 (a power of two)."""
    scale = 1
    while min(sizes) // 4 // (2 * scale) >= 64:
        scale *= 2
    return scale


def model(run: Run, figures: Figures | None, scale: int, latency_s: float, bytes_per_s: float) -> netsim.Model:
    cpu = figures.cpu if figures is not None else netsim.Cpu(1, 0.0, 0.0)
    return netsim.Model(latency_s=latency_s, bytes_per_s=bytes_per_s, hosts=run.hosts, scale=scale, cpu=cpu)


def count(run: Run, nbytes: int, scale: int, latency_s: float, bytes_per_s: float) -> tuple[float, float]:
    """The frames and (virtual) bytes a rank sends and takes, on average, in one allreduce of
    ``nbytes`` under auto on the run's ranks."""
    x = np.ones(nbytes // 4 // scale, dtype=np.float32)

    async def call(session: Session, rank: int) -> np.ndarray:
        return await collectives.allreduce(session, x, op="sum", name="x", chunk_bytes=CHUNK // scale, timeout_s=1e6)

    async def main() -> tuple[float, float]:
        network = netsim.Network(model(run, None, scale, latency_s, bytes_per_s), run.workers)
        await netsim.simulate(run.workers, call, network.model, links=CLASSES[link_class(run)], hierarchical="auto",
                              network=network)
        return statistics.fmean(network.frames), statistics.fmean(network.handled)

    return vclock.run(main())


def calibrate(run: Run, cores: int, handoffs: int, scale: int, latency_s: float,
              bytes_per_s: float) -> tuple[Figures, dict[int, Any]]:
    """The CPU figures from ``run``'s CPU per allreduce: call_s + frames x frame_s + bytes x
    byte_s, one equation per size (least squares over more than three)."""
    if "cpu" not in run.cpu:
        raise SystemExit(f"{run.source} recorded no CPU per allreduce: calibrate from a run of scale.py that does.")
    counts = {s: count(run, s, scale, latency_s, bytes_per_s) for s in run.sizes}
    a = np.array([[1.0, counts[s][0], counts[s][1]] for s in run.sizes])
    b = np.array([run.cpu["cpu"][s] for s in run.sizes])
    (call_s, frame_s, byte_s), *_ = np.linalg.lstsq(a, b, rcond=None)
    if min(call_s, frame_s, byte_s) < 0:
        raise SystemExit(f"The CPU figures of {run.source} fit no model of positive costs: call {call_s:.3g} s, "
                         f"frame {frame_s:.3g} s, byte {byte_s:.3g} s.")
    fill = statistics.fmean(run.cpu["fill_cpu"][s] / s for s in run.sizes if s >= 1 << 20)
    check = statistics.fmean(run.cpu["check_cpu"][s] / s for s in run.sizes if s >= 1 << 20)
    cpu = netsim.Cpu(cores, float(frame_s), float(byte_s), handoffs)
    figures = Figures(cpu, float(call_s), fill, check, latency_s, bytes_per_s)
    return figures, {s: {"frames": counts[s][0], "bytes": counts[s][1], "cpu_s": run.cpu["cpu"][s]} for s in run.sizes}


def slowed(figures: Figures, others_cpu: float) -> Figures:
    """The figures on a machine whose other processes took ``others_cpu`` of its cores: every
    core that much slower (its cores' share left to the job)."""
    cores = figures.cpu.cores
    k = cores / max(cores - others_cpu, 0.1 * cores)
    cpu = netsim.Cpu(cores, figures.cpu.frame_s * k, figures.cpu.byte_s * k, figures.cpu.handoffs)
    return Figures(cpu, figures.call_s * k, figures.fill_s * k, figures.check_s * k, figures.latency_s,
                   figures.bytes_per_s)


def simulate(run: Run, figures: Figures, scale: int, steps: int) -> dict[int, tuple[float, float]]:
    """The run's loop for ``steps`` steps in the model: per size, the median over steps (the first
    left out, as the harness leaves out a view's first) of the slowest rank's time, and the median
    of every rank's. Where the run measured what else the machine ran, the cores are that much
    slower (``slowed``)."""
    figures = slowed(figures, run.others_cpu)
    n = run.workers
    times: dict[int, list[list[float]]] = {s: [[0.0] * n for _ in range(steps)] for s in run.sizes}
    chunk = CHUNK // scale

    async def call(session: Session, rank: int) -> bool:
        loop = asyncio.get_running_loop()
        vectors = {s: np.empty(s // 4 // scale, dtype=np.float32) for s in run.sizes}
        flags = np.zeros(2, dtype=np.int64)
        ok = True
        for step in range(steps):
            for s in run.sizes:
                vectors[s].fill(1.0)
                await network.work(rank, figures.fill_s * s)
                begin = loop.time()
                await network.work(rank, figures.call_s / 2)  # the caller's thread hands the call to the loop's
                await collectives.allreduce(session, vectors[s], op="sum", name=f"scale.{s}", chunk_bytes=chunk,
                                            timeout_s=1e6, out=vectors[s])
                await network.work(rank, figures.call_s / 2)  # and the loop's the result back
                times[s][step][rank] = loop.time() - begin
                ok = ok and bool((vectors[s] == n).all())
                await network.work(rank, figures.check_s * s)
            await network.work(rank, figures.call_s / 2)  # the commit: one allreduce of two numbers
            await collectives.allreduce(session, flags, op="max", name="ringserve.elastic.hosts", chunk_bytes=chunk,
                                        timeout_s=1e6)
            await network.work(rank, figures.call_s / 2)
        return ok

    network = netsim.Network(model(run, figures, scale, figures.latency_s, figures.bytes_per_s), n)

    async def main() -> netsim.Outcome:
        return await netsim.simulate(n, call, network.model, links=CLASSES[link_class(run)], hierarchical="auto",
                                     network=network)

    outcome = vclock.run(main())
    assert all(outcome.results), "a wrong sum in the simulation"
    return {s: (statistics.median(max(t) for t in times[s][1:]), statistics.median(x for t in times[s][1:] for x in t))
            for s in run.sizes}


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def calibrated_on(workers: list[int]) -> str:
    """The chart's words for the calibration runs: "N=16", or "N=16 and 128, grown with N"."""
    return f"N={workers[0]}" if len(workers) == 1 else f"N={' and '.join(map(str, sorted(workers)))}, grown with N"


def chart(rows: list[dict[str, Any]], path: str, calibrated: str) -> None:
    """Real against simulated time by N, one line per size: filled the real, hollow the model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display is needed

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, size in enumerate(sorted({r["bytes"] for r in rows})):
        mine = sorted((r for r in rows if r["bytes"] == size), key=lambda r: r["workers"])
        ns = [r["workers"] for r in mine]
        color = f"C{i}"
        ax.plot(ns, [r["real_s"] for r in mine], "o-", color=color, label=f"{label(size)} real")
        ax.plot(ns, [r["predicted_s"] for r in mine], "s--", color=color, markerfacecolor="none",
                label=f"{label(size)} simulated")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    workers = sorted({r["workers"] for r in rows})
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.set_xlabel("workers (N), on N/4 or N/8 hosts, 2 cores")
    ax.set_ylabel("s per allreduce (slowest rank, median over steps)")
    ax.set_title(f"Scale harness: real against simulated (CPU calibrated on {calibrated})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="scale.py results (--json) or run directories (--workdir)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN",
                   help="the run whose CPU per allreduce sets the model's (default: the smallest that has it); with "
                        "two runs, each figure grows with N as a power law through the two (Growth)")
    p.add_argument("--cores", type=int, default=0, help="the machine's cores (default: the calibration run's, or this machine's)")
    p.add_argument("--latency-us", type=float, default=30.0, help="one way between hosts, beside the CPU")
    p.add_argument("--gbps", type=float, default=80.0, help="per host link, beside the CPU")
    p.add_argument("--handoffs", type=int, default=2,
                   help="the threads a frame passes through on each side, each a wait for a core (a lane's or gRPC's, the loop's)")
    p.add_argument("--links", choices=sorted(CLASSES), help="the class auto plans by (default: what the run's calls ran)")
    p.add_argument("--steps", type=int, default=4, help="steps simulated (the first left out)")
    p.add_argument("--chart", help="write the chart of real against simulated time by N here (SVG or PNG)")
    p.add_argument("--json", help="write the rows and the figures here")
    args = p.parse_args()
    runs = sorted((load(r) for r in args.runs), key=lambda r: r.workers)
    if args.calibrate and len(args.calibrate) > 2:
        raise SystemExit(f"--calibrate takes one run or two, not {len(args.calibrate)}.")
    bases = [load(c) for c in args.calibrate] if args.calibrate else [r for r in runs if "cpu" in r.cpu][:1]
    if not bases:
        raise SystemExit("No run recorded its CPU per allreduce: give one with --calibrate.")
    for run in (*runs, *bases):
        run.links = args.links or ""
    sizes = sorted({s for r in (*runs, *bases) for s in r.sizes})
    scale = scale_for(sizes)
    cores = args.cores or bases[0].cores or os.cpu_count() or 1
    latency_s, bytes_per_s = args.latency_us * 1e-6, args.gbps * 1e9 / 8
    fitted: list[tuple[int, Figures]] = []
    fits: dict[str, Any] = {}
    for base in bases:
        figures, fit = calibrate(base, cores, args.handoffs, scale, latency_s, bytes_per_s)
        fitted.append((base.workers, figures))
        fits[base.source] = {"workers": base.workers, "call_s": figures.call_s, "frame_s": figures.cpu.frame_s,
                             "byte_s": figures.cpu.byte_s, "fill_s": figures.fill_s, "check_s": figures.check_s,
                             "sizes": {str(s): f for s, f in fit.items()}}
        print(f"calibrated on {base.source} (N={base.workers}): {cores} cores; per call {figures.call_s * 1e6:.0f} us, "
              f"per frame {figures.cpu.frame_s * 1e6:.1f} us, per byte {figures.cpu.byte_s * 1e9:.3f} ns (sent and "
              f"taken); fill {figures.fill_s * 1e9:.3f} ns/B, check {figures.check_s * 1e9:.3f} ns/B; each payload "
              f"byte stands for {scale}", flush=True)
        for s, f in fit.items():
            print(f"  {label(s)}: {f['frames']:.1f} frames, {f['bytes'] / s:.2f} x size sent and taken per rank; "
                  f"CPU {f['cpu_s'] * 1e3:.2f} ms", flush=True)
    growth = Growth.of(fitted)
    if growth.exponents:
        print("each figure x (N / {}) to the power: {}".format(
            growth.at_n, ", ".join(f"{name} {k:.3f}" for name, k in growth.exponents.items())), flush=True)
    rows: list[dict[str, Any]] = []
    for run in runs:
        cls = link_class(run)
        figures = growth.at(run.workers)
        predicted = simulate(run, figures, scale, args.steps)
        for s in run.sizes:
            slowest, median = predicted[s]
            if "cpu" in run.cpu:  # the model's CPU per call against the run's: the calibration's own check at other N
                frames, handled = count(run, s, scale, latency_s, bytes_per_s)
                model_cpu = figures.call_s + frames * figures.cpu.frame_s + handled * figures.cpu.byte_s
                print(f"N={run.workers:4d} {label(s):>6s} CPU per call: real {run.cpu['cpu'][s] * 1e3:.2f} ms, "
                      f"model {model_cpu * 1e3:.2f} ms", flush=True)
            rows.append({"workers": run.workers, "hosts": len(set(run.hosts)), "bytes": s, "links": cls,
                         "others_cpu": run.others_cpu,
                         "plan": planned_names(run, cls, s), "real_s": run.slowest_s[s], "predicted_s": slowest,
                         "ratio": slowest / run.slowest_s[s], "real_median_s": run.median_s.get(s, float("nan")),
                         "predicted_median_s": median, "load": run.load, "source": run.source,
                         "real_cpu_s": run.cpu.get("cpu", {}).get(s), "calibrated": run.source in fits})
            ratio = slowest / run.slowest_s[s]
            print(f"N={run.workers:4d} on {len(set(run.hosts)):2d} hosts ({cls}, others {run.others_cpu:.2f} core) "
                  f"{label(s):>6s} {planned_names(run, cls, s):24s} real {run.slowest_s[s] * 1e3:8.1f} ms  simulated "
                  f"{slowest * 1e3:8.1f} ms  ratio {ratio:.2f}{'' if abs(ratio - 1) <= 0.25 else '  (outside 25%)'}; "
                  f"median rank {run.median_s.get(s, float('nan')) * 1e3:.1f} against {median * 1e3:.1f} ms", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "calibration": [b.source for b in bases], "cores": cores, "latency_s": latency_s,
            "bytes_per_s": bytes_per_s, "scale": scale, "handoffs": args.handoffs, "fits": fits,
            "exponents": growth.exponents, "rows": rows}, indent=1))
    if args.chart:
        chart(rows, args.chart, calibrated_on([b.workers for b in bases]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
