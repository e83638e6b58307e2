"""Training step time: ringserve's DistributedOptimizer against DDP over gloo and one process alone.

    python benchmarks/training_step.py                       # worlds 2 and 4
    python benchmarks/training_step.py --worlds 4 --steps 40 --fusion-bytes 8388608

Every configuration runs in this same invocation, DDP and ringserve alternating, each ``--repeat``
times with the best run kept: an MLP 784-2048-2048-10 (5.8M parameters, float32), SGD, a batch of
64 per worker, one torch thread per worker. A step is zero_grad, forward, backward and optimizer
step; the table gives the median step time of the slowest rank, its ratios, and for ringserve how
the communication overlapped backward:

- comm during backward: the share of the allreduce time (union of the buckets' start-to-finish
  intervals) that ran while backward was still computing;
- backward with comm running: the share of backward's time during which an allreduce was running;
- exposed: how long step() waited for communication after backward had returned.

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
from _common import PYTHON, free_port, read_json, run_ranks, table  # noqa: E402

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
    elif args.role == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world)
        model = torch.nn.parallel.DistributedDataParallel(model)
        barrier = dist.barrier
    else:
        def barrier() -> None:
            return None

    steps, backward, exposed, comm, overlapped, backward_total = [], [], [], 0.0, 0.0, 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            barrier()
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
    result = {"step": statistics.median(steps), "backward": statistics.median(backward), "exposed": statistics.median(exposed) if exposed else 0.0,
              "overlap": overlapped / comm if comm else 0.0,
              "covered": overlapped / backward_total if backward_total else 0.0}
    pathlib.Path(args.out).write_text(json.dumps(result))
    if args.role == "ringserve":
        hvd.shutdown()
    elif args.role == "ddp":
        torch.distributed.destroy_process_group()


def _run(role: str, world: int, args: argparse.Namespace, tmp: pathlib.Path) -> list[dict[str, float]]:
    me = str(pathlib.Path(__file__).resolve())
    common = ["--role", role, "--world", str(world), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--fusion-bytes", str(args.fusion_bytes)]
    outs = [tmp / f"{role}{world}.{i}.json" for i in range(world)]
    env: dict[str, str] = {"OMP_NUM_THREADS": "1"}
    if role == "ringserve":
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
        port = str(free_port())
        run_ranks([[PYTHON, me, *common, "--port", port, "--out", str(o)] for o in outs], env, timeout_s=600)
    return [read_json(o) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2, help="runs of each configuration; the best counts")
    p.add_argument("--fusion-bytes", type=int, default=4 << 20, help="ringserve's fusion bucket size")
    p.add_argument("--role", choices=["main", "alone", "ddp", "ringserve"], default="main")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.role != "main":
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        where = pathlib.Path(tmp)
        alone = min(_run("alone", 1, args, where)[0]["step"] for _ in range(args.repeat))
        for world in args.worlds:
            # Alternate the two, and keep each one's best run: load from outside hits both alike.
            ddp_runs, rs_runs = [], []
            for _ in range(args.repeat):
                ddp_runs.append(max(r["step"] for r in _run("ddp", world, args, where)))
                rs_runs.append(_run("ringserve", world, args, where))
            ddp = min(ddp_runs)
            rs = min(rs_runs, key=lambda ranks: max(r["step"] for r in ranks))
            rs_step = max(r["step"] for r in rs)
            rows.append({"world": world, "alone": f"{alone * 1e3:.1f}", "ddp": f"{ddp * 1e3:.1f}",
                         "rs": f"{rs_step * 1e3:.1f}", "rs_ddp": f"{rs_step / ddp:.2f}",
                         "rs_alone": f"{rs_step / alone:.2f}", "ddp_alone": f"{ddp / alone:.2f}",
                         "overlap": f"{100 * min(r['overlap'] for r in rs):.0f}%",
                         "covered": f"{100 * min(r['covered'] for r in rs):.0f}%",
                         "exposed": f"{1e3 * max(r['exposed'] for r in rs):.1f}"})
    print(f"MLP 784-2048-2048-10, batch {BATCH} per worker, 1 torch thread per worker, {os.cpu_count()} cores; "
          f"median step time in ms over {args.steps} steps (slowest rank), best of {args.repeat} alternating runs; "
          f"fusion {args.fusion_bytes >> 10} KiB")
    print(table(rows, [("world", "world"), ("alone", "alone ms"), ("ddp", "DDP-gloo ms"), ("rs", "ringserve ms"),
                       ("rs_ddp", "ringserve / DDP"), ("rs_alone", "ringserve / alone"),
                       ("ddp_alone", "DDP / alone"), ("overlap", "comm during backward"),
                       ("covered", "backward with comm running"),
                       ("exposed", "exposed comm ms")]))


if __name__ == "__main__":
    main()
