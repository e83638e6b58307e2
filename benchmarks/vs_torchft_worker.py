"""One worker of benchmarks/vs_torchft.py: the same training loop on plain DDP, torchft or ringserve.

    vs_torchft_worker.py --system {ddp,torchft,ringserve} --mode {train,diloco} --log PATH --stop PATH ...

Every system trains the issue's model, an MLP 784-512-512-10, with AdamW, a batch of 64 a worker,
one torch thread, each the way its own documentation writes the loop:

- ``ddp``: ``torch.distributed`` over gloo and ``DistributedDataParallel``: no fault tolerance.
- ``torchft``: a replica group of one, torchft's ``Manager`` (its Lighthouse started by the
  benchmark), ``torchft.DistributedDataParallel`` and ``torchft.Optimizer`` over
  ``ProcessGroupGloo``, in the order of torchft's own training loops (process group, Manager,
  model, DDP, optimizer); DiLoCo is ``torchft.local_sgd.DiLoCo`` with a synchronous quorum.
- ``ringserve``: ``hvd.init()`` first, as Horovod's scripts do, the ``DistributedOptimizer`` in a
  ``TorchState``, ``hvd.elastic.run`` and a commit after every step; DiLoCo is ``hvd.DiLoCo`` in a
  ``TorchState``, committed after each outer step.

DiLoCo runs H = ``--sync-every`` inner steps between syncs, with the paper's outer SGD (lr 0.7,
momentum 0.9, Nesterov) and uncompressed float32 pseudo-gradients on both, so that both send the
same bytes (``--compression int8`` gives ringserve's default codec instead).

After each committed step the worker appends one JSON line to ``--log``: ``t`` (wall clock, for
the benchmark to place it against a kill), ``step`` (the system's own committed step count, which
all replicas share; DiLoCo's inner steps), ``n`` (the replicas in that step), ``dt`` (the step's seconds, from
zero_grad to the end of its commit), ``sync`` (whether DiLoCo's outer step ran in it; ``n`` is 0
in DiLoCo's other steps) and ``commit`` (ringserve's ``state.commit()``, seconds, within ``dt``).
It stops once its step reaches the number that the benchmark writes into ``--stop``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from typing import IO, Any

BATCH = 64
BATCHES = 8  # batches made up front and cycled: the loop times training, not torch.randn


def model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def batches(seed: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(BATCHES)]


class Log:
    """The step records, and the step to stop at once the benchmark has written it."""

    def __init__(self, path: str, stop: str) -> None:
        self.out: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held for the process's life)
        self.stop = pathlib.Path(stop)
        self.stop_at = -1

    def write(self, step: int, n: int, dt: float, sync: bool = False, commit: float = 0.0) -> None:
        record = {"t": time.time(), "step": step, "n": n, "dt": round(dt, 6), "sync": sync, "commit": round(commit, 6)}
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def done(self, step: int) -> bool:
        if self.stop_at < 0 and self.stop.exists():
            text = self.stop.read_text().strip()
            self.stop_at = int(text) if text else -1
        return 0 <= self.stop_at <= step


def run_ddp(args: argparse.Namespace, log: Log) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
    net = torch.nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    data, loss_fn, step = batches(args.rank), torch.nn.CrossEntropyLoss(), 0
    while not log.done(step):
        t0 = time.perf_counter()
        x, y = data[step % BATCHES]
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        step += 1
        log.write(step, dist.get_world_size(), time.perf_counter() - t0)
    dist.destroy_process_group()


def run_torchft(args: argparse.Namespace, log: Log) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    diloco = args.mode == "diloco"
    # A replica group of one: its own store, as torchelastic would start for a group.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    holder: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        return {"model": holder["net"].state_dict(), "optim": holder["opt"].state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        holder["net"].load_state_dict(state["model"])
        holder["opt"].load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=2, use_async_quorum=not diloco, replica_id=f"replica_{args.rank}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, hostname="127.0.0.1", timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout)
    net = model()
    data, loss_fn, step = batches(args.rank), torch.nn.CrossEntropyLoss(), 0
    try:
        if diloco:
            inner = torch.optim.AdamW(net.parameters(), lr=1e-3)
            outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            holder.update(net=net, opt=inner)
            with DiLoCo(manager, [net], inner, outer, sync_every=args.sync_every):
                while not log.done(step):  # inner steps: the benchmark stops every replica after a sync
                    t0 = time.perf_counter()
                    x, y = data[step % BATCHES]
                    inner.zero_grad()
                    loss_fn(net(x), y).backward()
                    before = manager.current_step()
                    inner.step()  # every H-th: the quorum, the pseudo-gradients' allreduce, the outer step
                    step += 1
                    synced = manager.current_step() != before
                    log.write(step, manager.num_participants() if synced else 0, time.perf_counter() - t0, synced)
        else:
            ddp = DistributedDataParallel(manager, net)
            opt = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
            holder.update(net=ddp, opt=opt)
            while not log.done(manager.current_step()):
                t0 = time.perf_counter()
                x, y = data[step % BATCHES]
                opt.zero_grad()  # starts this step's quorum, in the background
                loss_fn(ddp(x), y).backward()
                before = manager.current_step()
                opt.step()  # commits only if every replica's allreduce went through
                step += 1
                if manager.current_step() != before:
                    log.write(manager.current_step(), manager.num_participants(), time.perf_counter() - t0)
    finally:
        manager.shutdown(wait=False)


def run_ringserve(args: argparse.Namespace, log: Log) -> None:
    import torch

    import ringserve.torch as hvd
    from ringserve.torch import elastic

    hvd.init()
    net = model()
    loss_fn = torch.nn.CrossEntropyLoss()
    pool = {rank: batches(rank) for rank in range(args.world)}  # made here, not inside a recovery
    if args.mode == "diloco":
        opt: Any = hvd.DiLoCo(net, inner=torch.optim.AdamW(net.parameters(), lr=1e-3), sync_every=args.sync_every,
                              outer_lr=0.7, outer_momentum=0.9, nesterov=True, compression=args.compression)
    else:
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3),
                                       named_parameters=net.named_parameters())
    state: Any = elastic.TorchState(model=net, optimizer=opt, step=0)  # state.step: an extra, as Horovod's

    @elastic.run
    def train(state: Any) -> None:
        data = pool[hvd.rank() % args.world]  # a rank's data follows its rank, as on the others
        while not log.done(state.step):
            t0 = time.perf_counter()
            x, y = data[state.step % BATCHES]
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            if args.mode == "diloco":
                outer = opt.outer_steps
                opt.step()
                state.step += 1
                synced = opt.outer_steps != outer
                c0 = time.perf_counter()
                if synced:
                    state.commit()
                t1 = time.perf_counter()
                log.write(state.step, hvd.size() if synced else 0, t1 - t0, synced, t1 - c0)
            else:
                opt.step()
                state.step += 1
                c0 = time.perf_counter()
                state.commit()
                t1 = time.perf_counter()
                log.write(state.step, hvd.size(), t1 - t0, commit=t1 - c0)

    train(state)
    if args.mode == "diloco":
        opt.close()
    hvd.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=["ddp", "torchft", "ringserve"], required=True)
    p.add_argument("--mode", choices=["train", "diloco"], default="train")
    p.add_argument("--log", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--rank", type=int, default=0, help="this worker's index (its data, its replica id)")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--port", type=int, default=0, help="DDP's rendezvous port")
    p.add_argument("--lighthouse", default="", help="torchft's Lighthouse, http://host:port")
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--compression", default=None, help="ringserve's DiLoCo codec (default: none, float32)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="torchft's collective and quorum timeouts")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    log = Log(args.log, args.stop)
    {"ddp": run_ddp, "torchft": run_torchft, "ringserve": run_ringserve}[args.system](args, log)
    print(f"{args.system} worker {args.rank} (pid {os.getpid()}) stopped at its step {log.stop_at}", flush=True)


if __name__ == "__main__":
    main()
