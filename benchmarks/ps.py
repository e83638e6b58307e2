"""Parameter-server modes against ringserve's ring allreduce, to a fixed target loss; and push/pull
throughput with 1 and 2 shards.

    python benchmarks/ps.py                                   # every mode, every scenario
    python benchmarks/ps.py --modes ring ssp --scenarios straggler --repeat 3
    python benchmarks/ps.py --throughput                      # push/pull MB/s, 1 shard and 2

**The task**: an MLP 64-64-10 on scikit-learn's digits (1,797 images, shipped with it), SGD at lr
0.1, a batch of 32 per worker, until the cross-entropy over the whole set is at most 0.25
(checked every 5 steps, on each worker's current model). 4 workers, each a process with one torch
thread. A step is forward, backward, ``--compute-ms`` (20) of sleep at the end of backward, and
the optimizer's step: a step bound by an accelerator, which leaves the host's CPU to communication
(on this 2-core machine real compute in 4 processes would measure CPU contention, not the modes).
The ring's gradient allreduces start in backward and overlap the sleep, as they overlap a real
backward; the parameter server's push starts at step(), and its pull overlaps the next step only
where the mode allows (async, ssp).

**Modes**: ``ring``, ringserve's DistributedOptimizer (allreduce-SGD), elastic (hvd.elastic.run,
a commit every 10 steps) so that it survives a death; ``ddp``, torch's DistributedDataParallel on
gloo, the reference outside ringserve (not run when a worker is killed: gloo has no way to go on
without it, and the others would wait out its timeout and fail); and through 2 shard processes
``sync``, ``async``, ``ssp`` (staleness 2) and ``average`` (4 local steps per average).

**Scenarios**: all equal; one worker 3x slower (it sleeps 3 x compute-ms); one killed (SIGKILL)
halfway, at half the steps that mode needed with equal workers. The coordinator declares a worker
dead after 5 s of silence (the default heartbeat timeout), which bounds how long sync and ring wait for it.

**Reported**: wall time from the start (every worker ready) to the first worker that sees the
target; its ratio to ring's in the same scenario; steps of the fastest worker; MB sent plus
received per worker (the mean); and the shards' CPU seconds during the run.

**Throughput** (``--throughput``): 4 client processes push a float32 model of ``--mb`` MB
(gradients of ones) and pull it back, in async mode, as fast as they can for ``--seconds``; the
bytes moved per second, with the model on 1 shard, then on 2, each shard process pinned to a core
of its own (``sched_setaffinity``) and the clients on all cores.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import PYTHON, free_port, read_json, table

WORKERS = 4
TARGET = 0.25
LR = 0.1
BATCH = 32
CHECK_EVERY = 5
MODES = ["ring", "ddp", "sync", "async", "ssp", "average"]
SCENARIOS = ["equal", "straggler", "killed"]
HEARTBEAT_TIMEOUT_S = 5.0


# -- a training worker ---------------------------------------------------------------------


def _data() -> tuple[Any, Any]:
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    return torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target)


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _wait_for_go(tmp: pathlib.Path, on_ranked: Any = None) -> float:
    """Writes this worker's ready file once the world holds every worker (rank 0 admits those
    waiting), after ``on_ranked(rank)`` if given; returns the start time the driver writes once
    all are ready."""
    from ringserve import api

    go = tmp / "go"
    while not go.exists() or not go.read_text().strip():  # the driver renames it into place; older ones wrote it
        ctx = api.context()
        if ctx.worker.rank == 0 and ctx.worker.pending_workers:
            ctx.call(lambda w: w.admit_waiting(), 10.0)
        if ctx.worker.size == WORKERS:
            if on_ranked is not None:
                on_ranked(ctx.worker.rank)
                on_ranked = None
            (tmp / f"ready.{ctx.worker.worker_id}").touch()
        time.sleep(0.02)
    return float(go.read_text())


def worker(args: argparse.Namespace) -> None:
    import torch

    import ringserve as rs
    import ringserve.torch as hvd
    from ringserve import api
    from ringserve.torch.ps import ParameterServerOptimizer

    torch.set_num_threads(1)
    tmp = pathlib.Path(args.tmp)
    # Everything slow to import or build comes before joining: a process busy importing on a
    # loaded machine can miss heartbeats.
    x_all, y_all = _data()
    model = _mlp()
    probe = _mlp()
    loss_fn = torch.nn.functional.cross_entropy
    base = torch.optim.SGD(model.parameters(), lr=LR)
    rs.init()
    forward = model
    on_ranked = None
    if args.mode == "ring":
        opt: Any = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    elif args.mode == "ddp":
        opt = base

        def on_ranked(rank: int) -> None:  # gloo's rendezvous, before the clock starts
            nonlocal forward
            import datetime

            torch.distributed.init_process_group("gloo", rank=rank, world_size=WORKERS,
                                                 timeout=datetime.timedelta(seconds=60))
            forward = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's values
    else:
        extra = {"ssp": {"staleness": 2}, "average": {"average_every": 4}}.get(args.mode, {})
        opt = ParameterServerOptimizer(base, model, mode=args.mode, **extra)
    start = _wait_for_go(tmp, on_ranked)
    me = api.context().worker
    rank_at_start = me.rank
    slow = args.scenario == "straggler" and rank_at_start == WORKERS - 1
    victim = args.scenario == "killed" and rank_at_start == WORKERS - 1
    compute_s = args.compute_ms / 1000 * (3 if slow else 1)
    generator = torch.Generator().manual_seed(rank_at_start)
    done = tmp / "done"
    result: dict[str, Any] = {"rank": rank_at_start, "reached": None}

    def train_loop(state: Any = None) -> int:
        step = state.steps if state is not None else 0
        while True:
            if victim and step == args.die_step:
                os.kill(os.getpid(), signal.SIGKILL)
            index = torch.randint(0, len(x_all), (BATCH,), generator=generator)
            opt.zero_grad()
            loss_fn(forward(x_all[index]), y_all[index]).backward()
            # The step's compute, as the end of backward: the ring's bucket allreduces overlap it,
            # as DDP's overlap a real backward; the parameter server's push waits for step().
            # (DDP itself waits for its allreduces inside backward(), so its sleep overlaps nothing.)
            time.sleep(compute_s)
            opt.step()
            step += 1
            if state is not None:
                state.steps = step
                if step % 10 == 0:
                    state.commit()
            if step % CHECK_EVERY == 0:
                probe.load_state_dict(model.state_dict())
                with torch.no_grad():
                    loss = loss_fn(probe(x_all), y_all).item()
                if loss <= TARGET:
                    result["reached"] = time.time()
                    if not done.exists():
                        done.write_text(str(result["reached"]))
                    return step
            if args.mode not in ("ring", "ddp") and done.exists():
                return step
            if step > 20000:
                return step

    if args.mode == "ring":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        state = hvd.elastic.TorchState(model, opt, steps=0)
        result["steps"] = hvd.elastic.run(train_loop)(state)
        counters = me.counters
        result["bytes"] = counters.bytes_sent + counters.bytes_received
    elif args.mode == "ddp":
        result["steps"] = train_loop()
        result["bytes"] = 0  # gloo does not count them
        torch.distributed.destroy_process_group()
    else:
        result["steps"] = train_loop()
        counts = opt.client.client.counts
        result["bytes"] = counts["bytes_sent"] + counts["bytes_received"]
        opt.close()
    result["start"] = start
    pathlib.Path(args.out).write_text(json.dumps(result))
    rs.shutdown()


# -- the driver ----------------------------------------------------------------------------


def _shard_cpu(coordinator: str) -> float:
    import grpc

    from ringserve._proto import coordinator_pb2 as cpb
    from ringserve._proto import coordinator_pb2_grpc as cpb_grpc
    from ringserve._proto import ps_pb2 as pb
    from ringserve._proto import ps_pb2_grpc as pb_grpc

    total = 0.0
    with grpc.insecure_channel(coordinator) as channel:
        listing = cpb_grpc.CoordinatorStub(channel).ListShards(cpb.ListShardsRequest(), timeout=5)
    for entry in listing.entries:
        with grpc.insecure_channel(entry.address) as channel:
            total += pb_grpc.ParameterServerStub(channel).Info(pb.InfoRequest(), timeout=5).cpu_s
    return total


def _job(shards: int, workers: int) -> tuple[Any, Any, Any]:
    from ringserve import Coordinator, CoordinatorConfig, ParameterServer
    from ringserve.config import ShardConfig
    from ringserve.loop import LoopThread

    thread = LoopThread(use_uvloop=True)
    coord = thread.run(Coordinator(CoordinatorConfig(
        min_workers=2, max_workers=workers, settle_s=1.0, heartbeat_interval_s=0.5,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)).start(), 10)
    server = ParameterServer(coord.address, shards=shards, config=ShardConfig()).start() if shards else None
    return thread, coord, server


def _stop(thread: Any, coord: Any, server: Any) -> None:
    if server is not None:
        server.stop()
    thread.run(coord.stop(0.1), 10)
    thread.stop()


def _go(tmp: pathlib.Path, start: float) -> None:
    """Tells the workers to start, atomically: they never read half the file."""
    (tmp / "go.tmp").write_text(str(start))
    (tmp / "go.tmp").rename(tmp / "go")


def run_one(mode: str, scenario: str, args: argparse.Namespace, die_step: int) -> dict[str, Any]:
    """One training run; returns the wall time to target and the per-worker figures."""
    import subprocess

    thread, coord, server = _job(0 if mode in ("ring", "ddp") else 2, WORKERS)
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = pathlib.Path(tmp_name)
            me = str(pathlib.Path(__file__).resolve())
            env = {**os.environ, "RINGSERVE_COORDINATOR": coord.address, "OMP_NUM_THREADS": "1",
                   "RINGSERVE_ELASTIC_TIMEOUT_S": "60", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            outs = [tmp / f"out.{i}.json" for i in range(WORKERS)]
            procs = [subprocess.Popen([PYTHON, me, "--role", "worker", "--mode", mode, "--scenario", scenario,
                                       "--tmp", tmp_name, "--out", str(o), "--die-step", str(die_step),
                                       "--compute-ms", str(args.compute_ms)],
                                      env={**env, "RINGSERVE_RANK_HINT": str(i)}) for i, o in enumerate(outs)]
            try:
                deadline = time.monotonic() + 300
                while len(list(tmp.glob("ready.*"))) < WORKERS:
                    codes = [p.poll() for p in procs]
                    if time.monotonic() > deadline or any(c is not None for c in codes):
                        raise RuntimeError(f"{mode}/{scenario}: the workers did not all get ready (exit codes "
                                           f"{codes}, {len(list(tmp.glob('ready.*')))} ready)")
                    time.sleep(0.05)
                cpu0 = _shard_cpu(coord.address) if server is not None else 0.0
                _go(tmp, time.time())
                for p in procs:
                    p.wait(600)
                cpu = _shard_cpu(coord.address) - cpu0 if server is not None else 0.0
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            results = [read_json(o) for o in outs if o.exists()]
    finally:
        _stop(thread, coord, server)
    reached = [r["reached"] for r in results if r["reached"]]
    if not reached:
        raise RuntimeError(f"{mode}/{scenario}: no worker reached the target loss {TARGET}")
    return {"wall": min(reached) - results[0]["start"], "steps": max(r["steps"] for r in results),
            "mb": statistics.mean(r["bytes"] for r in results) / 1e6, "cpu": cpu}


def training(args: argparse.Namespace) -> None:
    rows = []
    equal_steps: dict[str, int] = {}
    for scenario in args.scenarios:
        ring_wall: list[float] = []
        ddp_wall: list[float] = []
        for mode in args.modes:
            if mode == "ddp" and scenario == "killed":
                rows.append({"scenario": scenario, "mode": mode, "wall": "fails", "ratio": "-", "vs_ddp": "-",
                             "steps": "-", "mb": "-", "cpu": "-", "load": f"{os.getloadavg()[0]:.1f}"})
                print(f"{scenario:9} {mode:8} not run: gloo cannot go on without a rank", flush=True)
                continue
            walls, last = [], {}
            for _ in range(args.repeat):
                # Halfway: half the steps this mode needed with equal workers, measured in this
                # invocation, or --die-step when it did not run them.
                last = run_one(mode, scenario, args, max(1, equal_steps[mode] // 2) if mode in equal_steps
                               else args.die_step)
                walls.append(last["wall"])
                if scenario == "equal":
                    equal_steps[mode] = last["steps"]
            wall = min(walls)
            if mode == "ring":
                ring_wall = [wall]
            if mode == "ddp":
                ddp_wall = [wall]
            ratio = f"{wall / ring_wall[0]:.2f}" if ring_wall else "-"
            vs_ddp = f"{wall / ddp_wall[0]:.2f}" if ddp_wall else "-"
            mb = "-" if mode == "ddp" else f"{last['mb']:.1f}"
            rows.append({"scenario": scenario, "mode": mode, "wall": f"{wall:.2f}", "ratio": ratio, "vs_ddp": vs_ddp,
                         "steps": last["steps"], "mb": mb, "cpu": f"{last['cpu']:.1f}",
                         "load": f"{os.getloadavg()[0]:.1f}"})
            print(f"{scenario:9} {mode:8} {wall:6.2f} s  x{ratio} of ring  steps {last['steps']}  "
                  f"{mb} MB/worker  shards' CPU {last['cpu']:.1f} s  load {os.getloadavg()[0]:.1f}", flush=True)
    print()
    print(table(rows, [("scenario", "scenario"), ("mode", "mode"), ("wall", "wall s (best)"),
                       ("ratio", "vs ring"), ("vs_ddp", "vs DDP/gloo"), ("steps", "steps"), ("mb", "MB/worker"), ("cpu", "shards' CPU s"),
                       ("load", "load avg")]))


# -- throughput ----------------------------------------------------------------------------


def pusher(args: argparse.Namespace) -> None:
    import numpy as np

    import ringserve as rs
    from ringserve.ps import Client, Optimizer

    rs.init()
    count = args.mb * (1 << 20) // 4 // 8
    model = {f"t{i}": np.zeros(count, np.float32) for i in range(8)}
    ps = Client(model, mode="async", optimizer=Optimizer(kind="sgd", lr=1e-6))
    grads = {k: np.ones_like(v) for k, v in model.items()}
    start = _wait_for_go(pathlib.Path(args.tmp))
    while time.time() < start:
        time.sleep(0.001)
    cpu0 = time.process_time()
    rounds = 0
    while time.time() < start + args.seconds:
        ps.push(grads)
        ps.pull()
        rounds += 1
    moved = ps.client.counts["bytes_sent"] + ps.client.counts["bytes_received"]
    pathlib.Path(args.out).write_text(json.dumps({"rounds": rounds, "bytes": moved, "elapsed": time.time() - start,
                                                  "cpu": time.process_time() - cpu0}))
    ps.close()
    rs.shutdown()


def throughput(args: argparse.Namespace) -> None:
    import subprocess

    rows = []
    for shards in (1, 2):
        for _ in range(args.repeat):
            thread, coord, server = _job(shards, WORKERS)
            procs: list[Any] = []
            try:
                for index, pid in server.pids().items():
                    os.sched_setaffinity(pid, {index % os.cpu_count()})  # type: ignore[operator]
                with tempfile.TemporaryDirectory() as tmp_name:
                    tmp = pathlib.Path(tmp_name)
                    outs = [tmp / f"out.{i}.json" for i in range(WORKERS)]
                    me = str(pathlib.Path(__file__).resolve())
                    env = {**os.environ, "RINGSERVE_COORDINATOR": coord.address, "OMP_NUM_THREADS": "1"}
                    procs = [subprocess.Popen([PYTHON, me, "--role", "pusher", "--tmp", tmp_name, "--out", str(o),
                                               "--mb", str(args.mb), "--seconds", str(args.seconds)],
                                              env={**env, "RINGSERVE_RANK_HINT": str(i)}) for i, o in enumerate(outs)]
                    deadline = time.monotonic() + 300
                    while len(list(tmp.glob("ready.*"))) < WORKERS:
                        codes = [p.poll() for p in procs]
                        if time.monotonic() > deadline or any(c is not None for c in codes):
                            raise RuntimeError(f"{shards} shard(s): the pushers did not all get ready (exit codes "
                                               f"{codes})")
                        time.sleep(0.05)
                    cpu0 = _shard_cpu(coord.address)
                    _go(tmp, time.time() + 0.5)
                    for p in procs:
                        p.wait(args.seconds + 120)
                    if any(p.returncode for p in procs):
                        raise RuntimeError(f"{shards} shard(s): pushers failed: {[p.returncode for p in procs]}")
                    cpu = _shard_cpu(coord.address) - cpu0
                    results = [read_json(o) for o in outs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                _stop(thread, coord, server)
            rate = sum(r["bytes"] for r in results) / max(r["elapsed"] for r in results) / 1e6
            clients = sum(r["cpu"] for r in results) / args.seconds
            rows.append({"shards": shards, "rate": rate, "cpu": cpu / args.seconds, "clients": clients,
                         "rounds": sum(r["rounds"] for r in results)})
            print(f"{shards} shard(s): {rate:.0f} MB/s pushed + pulled, {rows[-1]['rounds']} rounds; cores busy: "
                  f"shards {cpu / args.seconds:.2f}, clients {clients:.2f}, load average {os.getloadavg()[0]:.1f}",
                  flush=True)
    best = {s: max(r["rate"] for r in rows if r["shards"] == s) for s in (1, 2)}
    print(f"\n2 shards / 1 shard: {best[2] / best[1]:.2f}x on {os.cpu_count()} cores "
          f"({WORKERS} client processes and the shards share them)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument("--repeat", type=int, default=1, help="runs of each cell; the best wall time counts")
    p.add_argument("--compute-ms", type=float, default=20.0, help="the sleep that stands for a step's compute")
    p.add_argument("--throughput", action="store_true", help="measure push/pull throughput, 1 shard and 2")
    p.add_argument("--mb", type=int, default=32, help="--throughput: the model's size")
    p.add_argument("--seconds", type=float, default=10.0, help="--throughput: how long each run pushes")
    p.add_argument("--role", choices=["main", "worker", "pusher"], default="main")
    p.add_argument("--mode", default="ring")
    p.add_argument("--scenario", default="equal")
    p.add_argument("--tmp", default="")
    p.add_argument("--out", default="")
    p.add_argument("--die-step", type=int, default=180,
                   help="killed, without equal in the same run: the step at which the victim dies (half of the "
                        "360 steps the modes take with equal workers)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # clean up on a kill
    if args.role == "worker":
        return worker(args)
    if args.role == "pusher":
        return pusher(args)
    if args.throughput:
        return throughput(args)
    return training(args)


if __name__ == "__main__":
    main()
