"""Time to a target loss over the emulated WAN: DDP's ways against ringserve's (``wan.py --to-target``).

    .venv/bin/python benchmarks/wan.py --to-target                       # every configuration
    .venv/bin/python benchmarks/wan.py --to-target --only ddp-gloo ddp-fp16 diloco-h50-int8

The network is wan.py's: four hosts in network namespaces, each behind a 100 Mbit/s uplink, 20 ms
one way from every other (see _netem.py), the shared-memory lane off.

The task (fixed): 10-way classification of 784-dimensional standard normal inputs, labelled by a
fixed random teacher (``argmax(tanh(x W1) W2)``, W1 784 x 32 and W2 32 x 10, seed 123); each rank
draws a fresh batch of 64 per step (seeded by rank and step); the held-out set is 1,024 other
inputs (seed 999). The model is training_step.py's MLP 784-2048-2048-10 (5.8M parameters, seed 0
on every rank), trained with AdamW (lr 1e-3): every step's optimizer in DDP and DistributedOptimizer,
the inner optimizer in DiLoCo. One torch thread per rank.

The target: DDP over gloo runs first, for ``--target-steps`` (100) steps; its held-out loss then is
the target. Every configuration then trains until its held-out loss is at or below the target, or
``--max-factor`` times that many steps (DiLoCo: ``--diloco-max-factor``), evaluated every 10 steps
(DiLoCo: after each outer step, on the global copy). Every rank evaluates the same parameters (the
same bytes on every rank) and stops alike; evaluation is not timed. Reported per configuration: the
wall time to the target (training steps only, slowest rank), the steps, the bytes each host sent
on the emulated links up to then (switch count, headers and ACKs included), and the held-out loss
and accuracy where it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from _common import OPEN_COORDINATOR, PYTHON, read_json, table
from _netem import Wan, interface_tx_bytes, read_counters

HELD_OUT = 1024
EVAL_EVERY = 10
LR = 1e-3
POWERSGD_START = 10  # steps of plain allreduce before PowerSGD compresses (torch's advice: about 10%)


@dataclass(frozen=True)
class Config:
    """One way to train: ``method`` and its knobs."""

    key: str
    label: str
    method: str  # ddp, ddp-ringserve, ringserve, diloco
    option: str = ""  # DDP's hook, or ringserve's compression
    sync_every: int = 0
    fragments: int = 1
    delay: int = 0

    @property
    def uses_ringserve(self) -> bool:
        return self.method != "ddp"


def configs(powersgd_rank: int) -> list[Config]:
    out = [Config("ddp-gloo", "DDP-gloo", "ddp", "gloo"),
           Config("ddp-fp16", "DDP fp16_compress_hook", "ddp", "fp16"),
           Config("ddp-powersgd", f"DDP powerSGD_hook rank {powersgd_rank}, one bucket (gloo)", "ddp", "powersgd-1bucket"),
           Config("ddp-powersgd-ringserve", f"DDP powerSGD_hook rank {powersgd_rank}, DDP's buckets, ringserve backend",
                  "ddp-ringserve", "powersgd"),
           Config("ringserve-int8", "ringserve int8 + error feedback", "ringserve", "int8"),
           Config("ringserve-powersgd", f"ringserve PowerSGD rank {powersgd_rank}", "ringserve", "powersgd")]
    for h in (10, 50, 100):
        for codec in ("int8", "none"):
            out.append(Config(f"diloco-h{h}-{codec}", f"DiLoCo H={h}, {'int8 + error feedback' if codec == 'int8' else 'uncompressed'}",
                              "diloco", codec, sync_every=h))
    out.append(Config("diloco-h50-int8-f2", "DiLoCo H=50, int8, 2 fragments, delay 1", "diloco", "int8", 50, 2, 1))
    out.append(Config("diloco-h100-int8-f2", "DiLoCo H=100, int8, 2 fragments, delay 5", "diloco", "int8", 100, 2, 5))
    return out


# -- the task --------------------------------------------------------------------------------------

class Task:
    """The teacher, the batches and the held-out set (see the module's docstring)."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator().manual_seed(123)
        self.w1 = torch.randn(784, 32, generator=g) / 28
        self.w2 = torch.randn(32, 10, generator=g) / math.sqrt(32)
        gh = torch.Generator().manual_seed(999)
        self.x_held = torch.randn(HELD_OUT, 784, generator=gh)
        self.y_held = self.labels(self.x_held)

    def labels(self, x: Any) -> Any:
        import torch

        return (torch.tanh(x @ self.w1) @ self.w2).argmax(1)

    def batch(self, rank: int, step: int, size: int = 64) -> tuple[Any, Any]:
        import torch

        x = torch.randn(size, 784, generator=torch.Generator().manual_seed(1_000_003 * rank + step))
        return x, self.labels(x)

    def evaluate(self, model: Any) -> tuple[float, float]:
        import torch

        with torch.no_grad():
            out = model(self.x_held)
            return float(torch.nn.functional.cross_entropy(out, self.y_held)), float((out.argmax(1) == self.y_held).float().mean())


# -- one rank ----------------------------------------------------------------------------------------

def _ddp(args: argparse.Namespace, rank: int, model: Any) -> Any:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.run_timeout)
    if args.method == "ddp-ringserve":
        import ringserve.torch  # noqa: F401  registers the backend

        dist.init_process_group("ringserve", init_method="ringserve://", rank=rank, world_size=args.world, timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank,
                                world_size=args.world, timeout=timeout)
    one_bucket = {"bucket_cap_mb": 1024} if args.option == "powersgd-1bucket" else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **one_bucket)
    if args.option == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.option.startswith("powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _setup(args: argparse.Namespace, rank: int, model: Any) -> tuple[Any, Any, Any, Any]:
    """(the module to train, its optimizer, a barrier, the module to evaluate or a function that
    returns it) for ``args.method``."""
    import torch

    if args.method in ("ddp", "ddp-ringserve"):
        import torch.distributed as dist

        ddp = _ddp(args, rank, model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), dist.barrier, model
    import ringserve.torch as hvd

    hvd.init()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    if args.method == "ringserve":
        compression: dict[str, Any] = (
            {"compression": hvd.Compression.powersgd(rank=args.powersgd_rank, start_powerSGD_iter=POWERSGD_START)}
            if args.option == "powersgd" else {"compression": hvd.Compression.int8, "error_feedback": True})
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **compression)
        return model, opt, hvd.barrier, model
    opt = hvd.DiLoCo(model, inner=inner, sync_every=args.sync_every, compression=None if args.option == "none" else args.option,
                     fragments=args.fragments, fragment_sync_delay=args.delay)
    shadow = _model()

    def global_model() -> Any:
        with torch.no_grad():
            for p, g in zip(shadow.parameters(), opt.global_parameters(), strict=True):
                p.copy_(g)
        return shadow

    return model, opt, hvd.barrier, global_model


def _model() -> Any:
    from training_step import _model as mlp

    return mlp()


def worker(args: argparse.Namespace) -> None:
    """One rank: train until the held-out loss reaches the target (or the step cap); write the evaluations."""
    import faulthandler

    import torch

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    rank = int(os.environ["RINGSERVE_RANK_HINT"])
    task = Task()
    model, opt, barrier, evaluated = _setup(args, rank, _model())
    loss_fn = torch.nn.CrossEntropyLoss()
    barrier()
    start, nic_start = read_counters(args.counters), interface_tx_bytes()
    trained, evals, last_outer = 0.0, [], 0
    for step in range(1, args.max_steps + 1):
        t0 = time.perf_counter()
        x, y = task.batch(rank, step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        trained += time.perf_counter() - t0
        if args.method == "diloco":
            due = opt.outer_steps != last_outer and opt.outer_steps % args.fragments == 0
            last_outer = opt.outer_steps
        else:
            due = step % EVAL_EVERY == 0
        if not due:
            continue
        loss, acc = task.evaluate(evaluated() if callable(evaluated) and not isinstance(evaluated, torch.nn.Module) else evaluated)
        sent = [b - a for a, b in zip(start, read_counters(args.counters), strict=True)]
        evals.append({"step": step, "time": trained, "loss": loss, "acc": acc, "sent": sent})
        if not math.isnan(args.target) and loss <= args.target:
            break
    if args.method == "diloco":
        opt.close()
    barrier()
    pathlib.Path(args.out).write_text(json.dumps({"evals": evals, "nic": interface_tx_bytes() - nic_start}))


# -- the driver ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    config: Config
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    def reached(self, target: float) -> dict[str, Any] | None:
        evals = self.ranks[0]["evals"] if self.ranks else []
        return next((e for e in evals if e["loss"] <= target), None)

    def time_at(self, step: int) -> float:
        return max(next(e["time"] for e in r["evals"] if e["step"] == step) for r in self.ranks)


def run_config(wan: Wan, args: argparse.Namespace, config: Config, tmp: pathlib.Path, target: float,
               max_steps: int, port: int) -> Outcome:
    from wan import Stalled, dump_stacks, host_env

    common = [PYTHON, str(pathlib.Path(__file__).resolve().with_name("wan.py")), "--to-target", "--role", "rank",
              "--method", config.method, "--option", config.option, "--sync-every", str(config.sync_every),
              "--fragments", str(config.fragments), "--delay", str(config.delay), "--max-steps", str(max_steps),
              "--target", repr(target), "--world", str(len(wan.hosts)), "--run-timeout", str(args.run_timeout),
              "--powersgd-rank", str(args.powersgd_rank), "--counters", wan.counters_path,
              "--master", wan.hosts[0].address, "--port", str(port)]
    env: dict[str, str] = {}
    coordinator = None
    host0 = wan.hosts[0]
    if config.uses_ringserve:
        coordinator = subprocess.Popen(wan.command(host0, [PYTHON, "-m", "ringserve.cli", "coordinator", "--host",
                                                           host0.address, "--port", str(port + 1), "--min-workers",
                                                           str(len(wan.hosts)), "--max-workers", str(len(wan.hosts)),
                                                           # A benchmark, not a failure test: a rank starved of CPU
                                                           # on a loaded machine must not be taken for dead.
                                                           "--heartbeat-timeout", "60"], OPEN_COORDINATOR))
        wan.wait_listening(host0, port + 1, timeout_s=30)
        env = {"RINGSERVE_COORDINATOR": f"{host0.address}:{port + 1}", "RINGSERVE_SHARED_MEMORY": "0"}
    outs = [tmp / f"{config.key}.{h.index}.json" for h in wan.hosts]
    procs = [subprocess.Popen(wan.command(h, [*common, "--out", str(o)], {**env, **host_env(h)}),
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RINGSERVE_RANK_HINT": str(h.index)})
             for h, o in zip(wan.hosts, outs, strict=True)]
    outcome = Outcome(config)
    deadline = time.monotonic() + args.run_timeout
    try:
        for i, p in enumerate(procs):
            try:
                code = p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                dump_stacks(config.label, procs)
                raise Stalled(f"{config.label}: ranks still running after {args.run_timeout:g} s") from None
            if code != 0:
                raise RuntimeError(f"{config.label}: rank {i} exited with code {code}")
        outcome.ranks = [read_json(o) for o in outs]
        losses = {tuple(e["loss"] for e in r["evals"]) for r in outcome.ranks}
        if len(losses) != 1:
            outcome.error = "the ranks evaluated different parameters"
    except (Stalled, RuntimeError) as e:
        outcome.error = str(e)
    finally:
        for p in [*procs, *([coordinator] if coordinator else [])]:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    wan.check_switch()
    return outcome


def rows(outcomes: list[Outcome], target: float, fp16_time: float | None) -> list[dict[str, object]]:
    out = []
    for o in outcomes:
        row: dict[str, object] = {"config": o.config.label, "time": "-", "ratio": "-", "steps": "-", "mb": "-",
                                  "loss": "-", "acc": "-"}
        if o.error or not o.ranks:
            row["time"] = f"failed: {o.error}"[:60]
            out.append(row)
            continue
        hit = o.reached(target)
        last = o.ranks[0]["evals"][-1] if o.ranks[0]["evals"] else None
        shown = hit or last
        if shown is None:
            out.append(row)
            continue
        t = o.time_at(shown["step"])
        row.update(time=f"{t:.1f}" if hit else f"not reached ({t:.0f} s)", steps=str(shown["step"]),
                   mb=f"{statistics.mean(shown['sent']) / 1e6:.1f}", loss=f"{shown['loss']:.4f}",
                   acc=f"{100 * shown['acc']:.1f}%")
        if hit and fp16_time:
            row["ratio"] = f"{t / fp16_time:.3f}"
        out.append(row)
    return out


def _summary(outcome: Outcome, target: float) -> str:
    if outcome.error:
        return f"failed: {outcome.error}"
    hit = outcome.reached(target)
    if hit is None:
        return "target not reached"
    return f"target at step {hit['step']}, {outcome.time_at(hit['step']):.1f} s"


def main(args: argparse.Namespace) -> None:
    from wan import _interrupt, check_environment, next_port

    if args.role == "rank":
        return worker(args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    check_environment()
    chosen = [c for c in configs(args.powersgd_rank) if not args.only or c.key in args.only]
    given = not math.isnan(args.target_loss)
    if given:
        chosen = [c for c in chosen if c.key != "ddp-gloo"]  # the target is given: no need to set it
    elif chosen[0].key != "ddp-gloo":
        chosen.insert(0, configs(args.powersgd_rank)[0])  # it sets the target
    outcomes: list[Outcome] = []
    with Wan(args.world, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as wan:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            target = args.target_loss
            for c in chosen:
                cap = args.target_steps if c.key == "ddp-gloo" else int(
                    args.target_steps * (args.diloco_max_factor if c.method == "diloco" else args.max_factor))
                t0 = time.monotonic()
                outcome = run_config(wan, args, c, pathlib.Path(tmp), target, cap, next_port(2))
                outcomes.append(outcome)
                if c.key == "ddp-gloo":
                    if outcome.error or not outcome.ranks[0]["evals"]:
                        raise SystemExit(f"wan.py: DDP-gloo, which sets the target, failed: {outcome.error}")
                    target = outcome.ranks[0]["evals"][-1]["loss"]
                    print(f"target: the held-out loss of DDP-gloo after {args.target_steps} steps, {target:.4f}", flush=True)
                print(f"{c.label}: {_summary(outcome, target)} ({time.monotonic() - t0:.0f} s, "
                      f"load {os.getloadavg()[0]:.1f})", flush=True)
    fp16 = next((o for o in outcomes if o.config.key == "ddp-fp16" and not o.error and o.reached(target)), None)
    fp16_time = fp16.time_at(fp16.reached(target)["step"]) if fp16 else None  # type: ignore[index]
    print(f"\n{args.world} hosts, {args.rate_mbit:g} Mbit/s uplink, {args.delay_ms:g} ms one way; target: held-out loss "
          f"{target:.4f} ({'given' if given else 'DDP-gloo'} after {args.target_steps} steps); AdamW lr {LR}, batch 64 per rank, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")
    print(table(rows(outcomes, target, fp16_time),
                [("config", "config"), ("time", "s to target"), ("ratio", "vs DDP fp16"), ("steps", "steps"),
                 ("mb", "MB sent per host"), ("loss", "held-out loss"), ("acc", "held-out accuracy")]))
    _save_json(args, outcomes, target, fp16_time, given)


def _save_json(args: argparse.Namespace, outcomes: list[Outcome], target: float, fp16_time: float | None,
               given: bool) -> None:
    """wan.py's --json: the table's rows and the run's circumstances (benchmarks/plots.py draws them)."""
    if getattr(args, "json", ""):
        from _results import save

        save(args.json, "wan_target", rows(outcomes, target, fp16_time), target_loss=target, target_given=given,
             target_steps=args.target_steps, hosts=args.world, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", nargs="*", default=[], help="configuration keys to run (DDP-gloo always runs first)")
    p.add_argument("--target-steps", type=int, default=100, help="DDP-gloo's steps, whose held-out loss is the target")
    p.add_argument("--target-loss", type=float, default=math.nan,
                   help="the target, from an earlier run's DDP-gloo (then DDP-gloo does not run)")
    p.add_argument("--max-factor", type=float, default=2.0, help="step cap of the other step-synchronous runs, x target-steps")
    p.add_argument("--diloco-max-factor", type=float, default=3.0, help="DiLoCo's step cap, x target-steps")
    p.add_argument("--run-timeout", type=float, default=1500, help="seconds one configuration may take")
    p.add_argument("--method", default="", help=argparse.SUPPRESS)
    p.add_argument("--sync-every", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fragments", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--delay", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--target", type=float, default=math.nan, help=argparse.SUPPRESS)
