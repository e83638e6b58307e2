"""Training step time: DDP over ringserve and ringserve's DistributedOptimizer against DDP over gloo.

    python benchmarks/training_step.py                       # worlds 2 and 4
    python benchmarks/training_step.py --worlds 4 --steps 40 --fusion-bytes 8388608

Every configuration runs in this same invocation, in rounds (``--repeat``): each round runs DDP
over gloo, DDP over ringserve (torch.distributed's "ringserve" backend), the same with shared memory
off (RINGSERVE_SHARED_MEMORY=0, as between hosts: payloads take the TCP payload lane) and with the
lane off too (every payload over the gRPC stream), and ringserve's Horovod-style
DistributedOptimizer with shared memory and with the lane, one after the other, so that each
round's runs see the same machine load (``--runs`` picks some; DDP over gloo always runs). The model is an MLP 784-2048-2048-10 (5.8M parameters, float32), SGD, a batch of
64 per worker, one torch thread per worker. A step is zero_grad, forward, backward and optimizer
step. The table gives, per world and run, the median step time of the slowest rank in its best
round, the ratio to DDP over gloo paired within each round (the median, and the range over the
rounds), the ratio to one process alone, and for the DistributedOptimizer how the communication
overlapped backward:

- comm during backward: the share of the allreduce time (union of the buckets' start-to-finish
  intervals) that ran while backward was still computing;
- backward with comm running: the share of backward's time during which an allreduce was running;
- exposed: how long step() waited for communication after backward had returned.

It also gives the CPU time of a step, all threads of all ranks together (``time.process_time``),
and its paired ratio to DDP over gloo's: on a small machine shared with other work, wall times
swing with the load, while what a run costs in CPU moves much less.

On a machine with fewer cores than workers, the workers and their communication threads share the
cores, so every distributed row is slower than "alone" for reasons that are not communication.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import PYTHON, free_port, read_json, run_ranks, table
from _results import save

BATCH = 64


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 10),
    )


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _overlap(intervals: list[tuple[float, float]], window: tuple[float, float]) -> tuple[float, float]:
    """(communication seconds, of which inside ``window``)."""
    total = inside = 0.0
    for a, b in _union(intervals):
        total += b - a
        inside += max(0.0, min(b, window[1]) - max(a, window[0]))
    return total, inside


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ.get("RINGSERVE_RANK_HINT", "0"))
    model = _model()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.01)
    hvd: Any = None
    if args.role == "ringserve":
        import ringserve.torch as hvd

        hvd.init()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), fusion_bytes=args.fusion_bytes)
        barrier = hvd.barrier
    elif args.role in ("ddp", "ddp-ringserve"):
        import torch.distributed as dist

        import ringserve.torch.distributed  # noqa: F401  registers "ringserve"

        backend = "gloo" if args.role == "ddp" else "ringserve"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world)
        model = torch.nn.parallel.DistributedDataParallel(model)
        barrier = dist.barrier
    else:
        def barrier() -> None:
            return None

    steps, backward, exposed, comm, overlapped, backward_total = [], [], [], 0.0, 0.0, 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            barrier()
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
        if hvd is not None:
            opt.synchronize()
            waited = time.perf_counter() - b1
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        t1 = time.perf_counter()
        if i >= args.warmup:
            steps.append(t1 - t0)
            backward.append(b1 - b0)
            if hvd is not None:
                exposed.append(waited)
                total, inside = _overlap(opt.communication_intervals, (b0, b1))
                comm += total
                overlapped += inside
                backward_total += b1 - b0
    cpu = (time.process_time() - cpu0) / args.steps  # every thread of this process, per timed step
    result = {"step": statistics.median(steps), "cpu": cpu, "backward": statistics.median(backward),
              "exposed": statistics.median(exposed) if exposed else 0.0,
              "overlap": overlapped / comm if comm else 0.0,
              "covered": overlapped / backward_total if backward_total else 0.0}
    pathlib.Path(args.out).write_text(json.dumps(result))
    if args.role == "ringserve":
        hvd.shutdown()
    elif args.role in ("ddp", "ddp-ringserve"):
        torch.distributed.destroy_process_group()


def _run(role: str, world: int, args: argparse.Namespace, tmp: pathlib.Path,
         extra_env: dict[str, str] | None = None) -> list[dict[str, float]]:
    me = str(pathlib.Path(__file__).resolve())
    common = ["--role", role, "--world", str(world), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--fusion-bytes", str(args.fusion_bytes), "--port", str(free_port())]
    outs = [tmp / f"{role}{world}.{i}.json" for i in range(world)]
    env: dict[str, str] = {"OMP_NUM_THREADS": "1", **(extra_env or {})}
    if role in ("ringserve", "ddp-ringserve"):
        from ringserve import Coordinator, CoordinatorConfig
        from ringserve.loop import LoopThread

        thread = LoopThread(use_uvloop=True)
        coord = Coordinator(CoordinatorConfig(min_workers=world, max_workers=world, settle_s=0.1))
        thread.run(coord.start(), 10)
        try:
            run_ranks([[PYTHON, me, *common, "--out", str(o)] for o in outs],
                      {**env, "RINGSERVE_COORDINATOR": coord.address}, timeout_s=600)
        finally:
            thread.run(coord.stop(0.1), 10)
            thread.stop()
    else:
        run_ranks([[PYTHON, me, *common, "--out", str(o)] for o in outs], env, timeout_s=600)
    return [read_json(o) for o in outs]


# The runs of each round, in order: (key for --runs, name in the table, role, extra environment).
LANE = {"RINGSERVE_SHARED_MEMORY": "0"}  # as between hosts: the TCP payload lane carries the payloads
STREAM = {"RINGSERVE_SHARED_MEMORY": "0", "RINGSERVE_PAYLOAD_LANE": "off"}
ALL_RUNS = [
    ("gloo", "DDP over gloo", "ddp", {}),
    ("ddp", "DDP over ringserve", "ddp-ringserve", {}),
    ("ddp-lane", "DDP over ringserve, payload lane", "ddp-ringserve", LANE),
    ("ddp-stream", "DDP over ringserve, stream-only", "ddp-ringserve", STREAM),
    ("hvd", "ringserve DistributedOptimizer", "ringserve", {}),
    ("hvd-lane", "ringserve DistributedOptimizer, payload lane", "ringserve", LANE),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3, help="rounds; each runs every configuration once")
    p.add_argument("--fusion-bytes", type=int, default=4 << 20, help="ringserve's fusion bucket size")
    p.add_argument("--runs", nargs="+", choices=[key for key, *_ in ALL_RUNS], default=[key for key, *_ in ALL_RUNS],
                   help="which runs each round makes (DDP over gloo always runs, as the base of the ratios)")
    p.add_argument("--role", choices=["main", "alone", "ddp", "ddp-ringserve", "ringserve"], default="main")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON (benchmarks/plots.py draws them)")
    args = p.parse_args()
    if args.role != "main":
        return worker(args)
    runs = [(name, role, env) for key, name, role, env in ALL_RUNS if key == "gloo" or key in args.runs]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        where = pathlib.Path(tmp)
        alone = min(_run("alone", 1, args, where)[0]["step"] for _ in range(args.repeat))
        for world in args.worlds:
            rounds: list[dict[str, list[dict[str, float]]]] = []
            for _ in range(args.repeat):
                rounds.append({name: _run(role, world, args, where, env) for name, role, env in runs})
            for name, _role, _env in runs:
                steps = [max(r["step"] for r in rnd[name]) for rnd in rounds]
                cpus = [sum(r["cpu"] for r in rnd[name]) for rnd in rounds]
                cpu_ratios = sorted(c / sum(r["cpu"] for r in rnd["DDP over gloo"]) for c, rnd in zip(cpus, rounds, strict=True))
                ratios = sorted(s / max(r["step"] for r in rnd["DDP over gloo"]) for s, rnd in zip(steps, rounds, strict=True))
                best = rounds[steps.index(min(steps))][name]
                hvd = name.startswith("ringserve DistributedOptimizer")
                rows.append({"world": world, "run": name, "step": f"{min(steps) * 1e3:.1f}",
                             "gloo": f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]",
                             "alone": f"{min(steps) / alone:.2f}",
                             "cpu": f"{statistics.median(cpus) * 1e3:.0f}",
                             "cpu_gloo": f"{statistics.median(cpu_ratios):.2f} [{cpu_ratios[0]:.2f}-{cpu_ratios[-1]:.2f}]",
                             "overlap": f"{100 * min(r['overlap'] for r in best):.0f}%" if hvd else "-",
                             "covered": f"{100 * min(r['covered'] for r in best):.0f}%" if hvd else "-",
                             "exposed": f"{1e3 * max(r['exposed'] for r in best):.1f}" if hvd else "-"})
    load = os.getloadavg()
    print(f"MLP 784-2048-2048-10, batch {BATCH} per worker, 1 torch thread per worker, {os.cpu_count()} cores "
          f"(load average {load[0]:.1f} at the end); one process alone: {alone * 1e3:.1f} ms; median step time of the "
          f"slowest rank over {args.steps} steps, best of {args.repeat} rounds; fusion {args.fusion_bytes >> 10} KiB")
    print(table(rows, [("world", "world"), ("run", "run"), ("step", "step ms"),
                       ("gloo", "/ DDP over gloo, paired: median [range]"), ("alone", "/ alone"),
                       ("cpu", "CPU ms/step, all ranks"), ("cpu_gloo", "CPU / DDP over gloo's: median [range]"),
                       ("overlap", "comm during backward"), ("covered", "backward with comm running"),
                       ("exposed", "exposed comm ms")]))
    if args.json:
        save(args.json, "training_step", rows, alone_ms=round(alone * 1e3, 2), steps=args.steps, rounds=args.repeat)


if __name__ == "__main__":
    main()
