"""Fault-tolerant HSDP (ringserve.torch.hsdp) against torch's own HSDP, in the same run.

    python benchmarks/hsdp.py --rounds 3 --json benchmarks/results/hsdp.json

Two replica groups of two ranks (four processes on loopback, one torch thread each) train issue
45's MLP (784-512-512-10, AdamW, a batch of 64 a rank), sharded by FSDP2 inside each group:

- **torch HSDP**: one gloo world of four, a 2 x 2 DeviceMesh (replicate, shard), ``fully_shard``
  over it: torch replicates across the groups itself, and nothing survives a death;
- **ringserve HSDP**: each group its own gloo process group (``hsdp.init``), ringserve averaging
  the shards across the groups, with ``hsdp.run`` and a commit every step (what a kill costs
  nothing of; tests/torch/test_hsdp.py kills groups);
- **ringserve HSDP, no commit**: the same without the commits, for what the commit costs.

Each round runs every system once, one after the other, in an order reversed every other round;
a system's figure is the median step time over every rank's steps after ``--warmup``, and the
ratio to torch's is paired within a round, then the median [range] over the rounds is printed.

    python benchmarks/hsdp.py --worker SYSTEM OUT STEPS   # one rank (the driver starts them)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Any

from _common import PYTHON, free_port, table, wait_all
from _results import save

SYSTEMS = ("torch", "ringserve", "ringserve-no-commit")
GROUPS, GROUP_SIZE = 2, 2
BATCH = 64


def _net() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _shard(model: Any, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if hasattr(layer, "weight"):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def worker(system: str, out: pathlib.Path, steps: int) -> None:
    """One rank: trains ``steps`` steps and writes its step times to ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    data = [(torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(8)]
    loss_fn = torch.nn.CrossEntropyLoss()
    times: list[float] = []
    model = _net()
    if system == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        _shard(model, init_device_mesh("cpu", (GROUPS, GROUP_SIZE), mesh_dim_names=("replicate", "shard")))
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(steps):
            t0 = time.perf_counter()
            x, y = data[step % len(data)]
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
    else:
        import ringserve.torch as hvd
        from ringserve.torch import hsdp

        group = hsdp.init()
        _shard(model, group.mesh)
        optimizer = hsdp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), group)
        state = hsdp.HSDPState(model, optimizer, group, step=0)
        commit = system == "ringserve"

        @hsdp.run
        def train(state: hsdp.HSDPState) -> None:
            while state.step < steps:
                t0 = time.perf_counter()
                x, y = data[state.step % len(data)]
                loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                state.step += 1
                if commit:
                    state.commit()
                times.append(time.perf_counter() - t0)

        train(state)
        hvd.shutdown()
    out.write_text(json.dumps(times))


def run(system: str, where: pathlib.Path, steps: int, timeout_s: float) -> list[list[float]]:
    """One job of ``system``: every rank's step times."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    procs, outs, coordinator = [], [], None
    try:
        if system != "torch":
            port = free_port()
            coordinator = subprocess.Popen([PYTHON, "-m", "ringserve.cli", "coordinator", "--port", str(port),
                                            "--min-workers", str(GROUPS * GROUP_SIZE), "--settle-seconds", "0.5"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            env["RINGSERVE_COORDINATOR"] = f"127.0.0.1:{port}"
        world_port = free_port()
        for g in range(GROUPS):
            group_port = free_port()
            for r in range(GROUP_SIZE):
                out = where / f"{system}-{g}-{r}.json"
                if system == "torch":
                    rank_env = {"RANK": str(g * GROUP_SIZE + r), "WORLD_SIZE": str(GROUPS * GROUP_SIZE),
                                "MASTER_PORT": str(world_port)}
                else:
                    rank_env = {"RANK": str(r), "WORLD_SIZE": str(GROUP_SIZE), "MASTER_PORT": str(group_port),
                                "RINGSERVE_HSDP_GROUP": f"g{g}"}
                procs.append(subprocess.Popen([PYTHON, __file__, "--worker", system, str(out), str(steps)],
                                              env={**env, **rank_env}))
                outs.append(out)
        wait_all(procs, timeout_s)
    finally:
        if coordinator is not None:
            coordinator.kill()
            coordinator.wait()
    return [json.loads(o.read_text()) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--json", help="write the rounds' figures here")
    p.add_argument("--worker", nargs=3, metavar=("SYSTEM", "OUT", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], pathlib.Path(args.worker[1]), int(args.worker[2]))
        return
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            print(f"round {k + 1} of {args.rounds}", flush=True)
            figures: dict[str, float] = {}
            for system in SYSTEMS if k % 2 == 0 else SYSTEMS[::-1]:
                where = pathlib.Path(tmp) / f"r{k}"
                where.mkdir(exist_ok=True)
                ranks = run(system, where, args.steps, args.timeout_s)
                figures[system] = statistics.median(t for times in ranks for t in times[args.warmup:])
                print(f"  {system}: {figures[system] * 1e3:.1f} ms a step", flush=True)
            rounds.append(figures)
    rows = []
    for system in SYSTEMS:
        times = [r[system] for r in rounds]
        ratios = [r[system] / r["torch"] for r in rounds]
        rows.append({"system": system, "step_ms": f"{statistics.median(times) * 1e3:.1f} "
                                                  f"[{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}]",
                     "vs_torch": f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"})
    print(f"{GROUPS} groups of {GROUP_SIZE} ranks on loopback, MLP 784-512-512-10, AdamW, batch {BATCH} a rank; "
          f"median [range] over {args.rounds} interleaved rounds; ratios paired within a round; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    print(table(rows, [("system", "system"), ("step_ms", "step time (ms)"), ("vs_torch", "/ torch HSDP")]))
    if args.json:
        save(args.json, "hsdp", rows, rounds=rounds)


if __name__ == "__main__":
    main()
