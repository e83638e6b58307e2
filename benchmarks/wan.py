"""Training step time over an emulated WAN: ringserve against DDP as a DDP user would run it.

    sudo .venv/bin/python benchmarks/wan.py                          # every configuration, 2 rounds
    sudo .venv/bin/python benchmarks/wan.py --codecs int8 --ddp gloo fp16 --rounds 1 --steps 4

Four hosts (``--world``) run in separate network namespaces, each behind a ``--rate-mbit`` uplink
(tbf) and ``--delay-ms`` one way from every other host (a delaying TUN switch, MTU ``--mtu``, 1500
as on real links, with TCP segmentation offload; see _netem.py for why and how). Every framework sees the same network: the
delay is added to IP packets, under every TCP connection. The configurations, on training_step.py's
MLP 784-2048-2048-10 (5.8M parameters, 23 MB of float32 gradients), a batch of 64 per worker, one
torch thread per worker:

- DDP over gloo (``--ddp``): plain (``gloo``), with ``fp16_compress_hook`` (``fp16``), and with
  ``powerSGD_hook`` at matrix approximation rank ``--powersgd-rank`` (4), error feedback and warm
  start on, compressing from the first timed step (``start_powerSGD_iter`` = the warmup steps; its
  default of 1,000 would time plain allreduce), with DDP's buckets (``powersgd``; it stalls over
  this WAN: see docs/benchmarks/wan.md) and with one bucket for the whole model (``powersgd-1bucket``);
- ringserve's DistributedOptimizer (``--codecs``): ``none``, ``fp16``, ``int8`` with error feedback,
  with the shared-memory lane off (``RINGSERVE_SHARED_MEMORY=0``). The hosts share one kernel, so
  the lane would otherwise carry every payload around the shaped links. Payloads take the TCP
  payload lane, as between real hosts (``RINGSERVE_PAYLOAD_LANE=off`` in the environment: the gRPC
  stream).

It runs every configuration once per round, ``--rounds`` times, in a rotated order, so that each
sees the machine's load swing alike. The table gives, per configuration, the median over the rounds
of the step time (the median over the timed steps of the slowest rank), its ratio to the best DDP
baseline of the same round (median and range over the rounds), and the bytes on the wire.

Every configuration must move its gradients over the emulated links, or the run fails: each rank
reads its uplink's kernel counter (``/sys/class/net/rsw0/statistics/tx_bytes`` in its namespace)
around the timed steps, the switch counts the IP bytes it forwards for each host, and both must
come to at least 0.9 of the ring's share of the configuration's payload, 2(N-1)/N times the
compressed gradient bytes ("wire / ring payload"). Before the runs, sanity lines give a bulk TCP
transfer's goodput with every host sending at once (what tbf lets through, and whether the switch
keeps up at this MTU) and the TCP connect time (one round trip, 2 x ``--delay-ms``).

A configuration that does not finish within ``--timeout`` is reported as stalled, with its ranks'
Python stacks, and the others still run. Needs root, ``ip``, ``tc`` and
/dev/net/tun; ``netem`` is not needed.

``--to-target`` measures time to a target loss instead (DDP, PowerSGD, DiLoCo): see wan_target.py.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import wan_target
from _common import OPEN_COORDINATOR, PYTHON, read_json, table
from _netcheck import connect_rtt_ms, ring_bulk_mbit
from _netem import DEVICE, EmulationUnavailable, Host, Wan, check_environment, interface_tx_bytes, read_counters
from _results import save
from training_step import BATCH, _model

CODECS = ("none", "fp16", "int8")
DDP_HOOKS = ("gloo", "fp16", "powersgd", "powersgd-1bucket")
WIRE_FLOOR = 0.9  # of the ring's share of the payload: less means the bytes went around the links
_ports = itertools.count(29500)  # fresh namespaces: any port is free; a new one per run skips TIME_WAIT


def next_port(count: int = 1) -> int:
    """A port not used before in this run (``count`` consecutive ones: the first is returned)."""
    first = next(_ports)
    for _ in range(count - 1):
        next(_ports)
    return first


@dataclass(frozen=True)
class Config:
    label: str
    role: str  # "ddp" or "ringserve"
    option: str  # the DDP hook or the ringserve codec

    @property
    def is_ddp(self) -> bool:
        return self.role == "ddp"


class Stalled(RuntimeError):
    """A configuration's ranks did not finish within the timeout."""


# -- the ranks ------------------------------------------------------------------------------------

def _compression(hvd: Any, codec: str) -> dict[str, Any]:
    """DistributedOptimizer keyword arguments for ``codec``."""
    if codec == "int8":
        return {"compression": hvd.Compression.int8, "error_feedback": True}
    return {"compression": getattr(hvd.Compression, codec)}


def _ddp(args: argparse.Namespace, rank: int, model: Any) -> Any:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
    # One bucket for the whole model (DDP's default is a 1 MiB first bucket, then 25 MiB ones): the
    # PowerSGD run that does not stall (see docs/benchmarks/wan.md).
    one_bucket = {"bucket_cap_mb": 1024} if args.option == "powersgd-1bucket" else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **one_bucket)
    if args.option == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.option.startswith("powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=max(2, args.warmup), use_error_feedback=True,
                                            warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _setup(args: argparse.Namespace, rank: int, model: Any, opt: Any) -> tuple[Any, Any, Callable[[], None], Callable[[], None]]:
    """Makes the model and optimizer distributed; returns them with a barrier and a finish function."""
    if args.role == "ddp":
        import torch.distributed as dist

        return _ddp(args, rank, model), opt, dist.barrier, dist.destroy_process_group
    import ringserve.torch as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), fusion_bytes=args.fusion_bytes,
                                   **_compression(hvd, args.option))
    return model, opt, hvd.barrier, hvd.shutdown


def worker(args: argparse.Namespace) -> None:
    """One rank: warmup steps, then timed steps between two barriers, with the wire's counters read at each."""
    import faulthandler

    import torch

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's stack dump, if this run stalls
    torch.set_num_threads(1)
    rank = int(os.environ["RINGSERVE_RANK_HINT"])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    model = _model()
    model, opt, barrier, finish = _setup(args, rank, model, torch.optim.SGD(model.parameters(), lr=0.01))

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    barrier()
    before, nic_before = read_counters(args.counters), interface_tx_bytes()
    times = [step() for _ in range(args.steps)]
    barrier()
    after, nic_after = read_counters(args.counters), interface_tx_bytes()
    sent = [b - a for a, b in zip(before, after, strict=True)]
    pathlib.Path(args.out).write_text(json.dumps({"step": statistics.median(times), "sent": sent,
                                                  "nic": nic_after - nic_before}))
    finish()


# -- the driver -----------------------------------------------------------------------------------

def host_env(host: Host) -> dict[str, str]:
    """What makes a rank use its host's address: gloo binds DEVICE's address, ringserve the given one."""
    return {"GLOO_SOCKET_IFNAME": DEVICE, "RINGSERVE_BIND_HOST": host.address, "RINGSERVE_HOSTNAME": f"h{host.index}"}


def _run_ranks(wan: Wan, args: argparse.Namespace, tmp: pathlib.Path, config: Config, role_argv: list[str],
               env: dict[str, str]) -> list[dict[str, Any]]:
    """Runs ``wan.py <role_argv>`` once per host, in its namespace; returns the ranks' results.

    Raises:
        Stalled: a rank had not finished after ``args.timeout`` (after its stacks are printed).
    """
    common = [PYTHON, str(pathlib.Path(__file__).resolve()), *role_argv, "--world", str(len(wan.hosts)),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--fusion-bytes", str(args.fusion_bytes),
              "--timeout", str(args.timeout), "--powersgd-rank", str(args.powersgd_rank),
              "--counters", wan.counters_path]
    outs = [tmp / f"{config.role}-{config.option}.{h.index}.json" for h in wan.hosts]
    procs = [subprocess.Popen(wan.command(h, [*common, "--out", str(o)], {**env, **host_env(h)}),
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RINGSERVE_RANK_HINT": str(h.index)})
             for h, o in zip(wan.hosts, outs, strict=True)]
    deadline = time.monotonic() + args.timeout
    try:
        for i, p in enumerate(procs):
            try:
                code = p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                dump_stacks(config.label, procs)
                raise Stalled(f"{config.label}: ranks still running after {args.timeout:g} s") from None
            if code != 0:
                raise RuntimeError(f"{config.label}: rank {i} exited with code {code}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wan.check_switch()
    return [read_json(o) for o in outs]


def dump_stacks(label: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Makes each stalled rank print its threads' Python stacks (faulthandler, on SIGUSR1)."""
    print(f"--- {label} stalled: the ranks' stacks follow ---", flush=True)
    for i, p in enumerate(procs):
        if p.poll() is None:
            print(f"--- rank {i} ---", flush=True)
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.5)  # one rank at a time: they share the terminal


def _run(wan: Wan, args: argparse.Namespace, config: Config, tmp: pathlib.Path) -> list[dict[str, Any]]:
    if config.is_ddp:
        role = ["--role", "ddp", "--option", config.option, "--master", wan.hosts[0].address,
                "--port", str(next(_ports))]
        return _run_ranks(wan, args, tmp, config, role, {})
    host0, port, world = wan.hosts[0], next(_ports), str(len(wan.hosts))
    coordinator = subprocess.Popen(wan.command(host0, [PYTHON, "-m", "ringserve.cli", "coordinator", "--host",
                                                       host0.address, "--port", str(port), "--min-workers", world,
                                                       "--max-workers", world], OPEN_COORDINATOR))
    try:
        wan.wait_listening(host0, port, timeout_s=30)
        env = {"RINGSERVE_COORDINATOR": f"{host0.address}:{port}", "RINGSERVE_SHARED_MEMORY": "0"}
        return _run_ranks(wan, args, tmp, config, ["--role", "ringserve", "--option", config.option], env)
    finally:
        coordinator.terminate()
        try:
            coordinator.wait(10)
        except subprocess.TimeoutExpired:
            coordinator.kill()
            coordinator.wait()


def payload_bytes(config: Config, powersgd_rank: int, min_compression_rate: float = 2.0) -> float:
    """The gradient bytes one rank contributes per step in ``config``, as encoded for the wire.

    PowerSGD's are its low-rank factors P and Q (float32) of every matrix it compresses (those
    where (n + m) r x min_compression_rate < n m, as the hook decides), plus every other gradient
    whole; biases count as whole.
    """
    shapes = [tuple(p.shape) for p in _model().parameters()]
    numel = sum(math.prod(s) for s in shapes)
    if config.option.startswith("powersgd"):
        total = 0
        for s in shapes:
            n, m = s[0], math.prod(s[1:]) if len(s) > 1 else 1
            r = min(n, m, powersgd_rank)
            total += 4 * ((n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m)
        return float(total)
    per_value = {"gloo": 4, "none": 4, "fp16": 2, "int8": 1}[config.option]
    return float(per_value * numel)


def _checked(config: Config, ranks: list[dict[str, Any]], args: argparse.Namespace, world: int) -> dict[str, float]:
    """The run's figures; raises unless every host's uplink carried the ring's share of the payload.

    Two accounts of each uplink: the switch's (the bytes on the wire of every segment it forwarded)
    and the kernel's interface counter, read by the host's rank (one header per offloaded packet).
    """
    switch = [b / args.steps for b in ranks[0]["sent"]]
    nic = [r["nic"] / args.steps for r in ranks]
    expected = 2 * (world - 1) / world * payload_bytes(config, args.powersgd_rank)
    for host, (by_switch, by_kernel) in enumerate(zip(switch, nic, strict=True)):
        if min(by_switch, by_kernel) < WIRE_FLOOR * expected:
            raise RuntimeError(
                f"{config.label}: host {host} sent {by_switch / 1e6:.2f} MB per step by the switch's count "
                f"({by_kernel / 1e6:.2f} MB by {DEVICE}'s kernel counter), below {WIRE_FLOOR} of the ring's share "
                f"of the payload ({expected / 1e6:.2f} MB): the gradients went around the emulated links")
    return {"step": max(r["step"] for r in ranks), "mean": statistics.mean(switch), "max": max(switch),
            "wire": statistics.mean(switch) / expected}


def _rows(configs: list[Config], rounds: list[dict[str, dict[str, float] | None]], args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for c in configs:
        done = [r[c.label] for r in rounds if r.get(c.label) is not None]
        if not done:
            rows.append({"config": c.label, "step": "stalled", "ratio": "-", "mb": "-", "wire": "-", "busy": "-"})
            continue
        ratios = []
        for r in rounds:
            mine = r.get(c.label)
            baselines = [v["step"] for k, v in r.items() if v is not None and k.startswith("DDP")]
            if mine is not None and baselines:
                ratios.append(mine["step"] / min(baselines))
        step = statistics.median(d["step"] for d in done)
        mean, top = statistics.median(d["mean"] for d in done), max(d["max"] for d in done)
        ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        stalls = len(rounds) - len(done)
        rows.append({"config": c.label + (f" ({stalls} of {len(rounds)} stalled)" if stalls else ""),
                     "step": f"{step * 1e3:.0f}", "ratio": ratio, "mb": f"{mean / 1e6:.2f} ({top / 1e6:.2f})",
                     "wire": f"{statistics.median(d['wire'] for d in done):.2f}",
                     "busy": f"{100 * 8 * mean / step / (args.rate_mbit * 1e6):.0f}%"})
    return rows


def _configs(args: argparse.Namespace) -> list[Config]:
    from ringserve.torch import Compression

    ddp_labels = {"gloo": "DDP-gloo", "fp16": "DDP fp16_compress_hook",
                  "powersgd": f"DDP powerSGD_hook rank {args.powersgd_rank}",
                  "powersgd-1bucket": f"DDP powerSGD_hook rank {args.powersgd_rank}, one bucket"}
    configs = [Config(ddp_labels[h], "ddp", h) for h in args.ddp]
    for codec in args.codecs:
        if not hasattr(Compression, codec):
            print(f"note: ringserve.torch.Compression has no {codec!r} yet; its row is skipped")
            continue
        configs.append(Config("ringserve int8 + error feedback" if codec == "int8" else f"ringserve {codec}",
                              "ringserve", codec))
    return configs


def _sanity(wan: Wan) -> list[str]:
    a, b = wan.hosts[0], wan.hosts[1]
    nbytes = int(wan.rate_mbit * 1e6 / 8 * 2)  # about 2 s at the configured rate
    ring = ring_bulk_mbit(wan.hosts, nbytes)
    return [f"bulk TCP, every host to the next at once, {nbytes / 1e6:.0f} MB each: "
            f"{min(ring):.1f}-{max(ring):.1f} Mbit/s goodput (tbf rate {wan.rate_mbit:g} Mbit/s, MTU {wan.mtu})",
            f"TCP connect {a.address} -> {b.address}: {connect_rtt_ms(a, b):.1f} ms median of 5 "
            f"(one round trip; 2 x {wan.delay_ms:g} ms delay expected)"]


def _interrupt(signum: int, frame: object) -> NoReturn:
    """Turns SIGINT and SIGTERM into KeyboardInterrupt, so that every ``finally`` tears down."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", nargs="*", choices=CODECS, default=list(CODECS), help="ringserve compressions to run")
    p.add_argument("--ddp", nargs="*", choices=DDP_HOOKS, default=list(DDP_HOOKS), help="DDP baselines to run")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's matrix approximation rank")
    p.add_argument("--rounds", type=int, default=2, help="runs of every configuration, interleaved")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay between any two hosts")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="each host's uplink rate")
    p.add_argument("--mtu", type=int, default=1500, help="the links' MTU (1500 as on real links)")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                   help="TCP segmentation offload on the emulated links (see _netem.py)")
    p.add_argument("--world", type=int, default=4, help="hosts, one rank each")
    p.add_argument("--fusion-bytes", type=int, default=4 << 20, help="ringserve's fusion bucket size")
    p.add_argument("--timeout", type=float, default=300, help="seconds one run may take before it counts as stalled")
    p.add_argument("--to-target", action="store_true", help="time to a target loss instead (see wan_target.py)")
    p.add_argument("--role", choices=["main", "ddp", "ringserve", "rank"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--option", default="none", help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--counters", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON (benchmarks/plots.py draws them)")
    wan_target.add_arguments(p)
    return p.parse_args()


def main() -> None:
    args = _parse()
    if args.to_target:
        return wan_target.main(args)
    if args.role != "main":
        return worker(args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    rounds: list[dict[str, dict[str, float] | None]] = []
    try:
        check_environment()
        configs = _configs(args)
        with Wan(args.world, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit, mtu=args.mtu,
                 offload=args.offload) as wan, \
                tempfile.TemporaryDirectory() as tmp:
            sanity = _sanity(wan)
            print("\n".join(sanity), flush=True)
            for n in range(args.rounds):
                results: dict[str, dict[str, float] | None] = {}
                for c in configs[n % len(configs):] + configs[:n % len(configs)]:
                    t0 = time.monotonic()
                    try:
                        results[c.label] = _checked(c, _run(wan, args, c, pathlib.Path(tmp)), args, args.world)
                    except Stalled as e:
                        print(f"round {n + 1}: {e}", flush=True)
                        results[c.label] = None
                        continue
                    print(f"round {n + 1}: {c.label}: {results[c.label]['step'] * 1e3:.0f} ms per step, "
                          f"{results[c.label]['mean'] / 1e6:.2f} MB per host per step on the links "
                          f"({time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
                rounds.append(results)
    except EmulationUnavailable as e:
        sys.exit(f"wan.py: {e}")
    except KeyboardInterrupt as e:
        sys.exit(f"wan.py: interrupted ({e or 'SIGINT'}); the emulated network was removed")
    print(f"\n{args.world} hosts, {args.rate_mbit:g} Mbit/s uplink (tbf), {args.delay_ms:g} ms one way, MTU {args.mtu}; "
          f"MLP 784-2048-2048-10, batch {BATCH} per worker, 1 torch thread per worker, {os.cpu_count()} cores "
          f"(load average {os.getloadavg()[0]:.1f} at the end); median over {args.rounds} interleaved rounds of the "
          f"median step over {args.steps} timed steps after {args.warmup} warmup (slowest rank); ringserve fusion "
          f"{args.fusion_bytes >> 10} KiB, shared-memory lane off; MB: bytes on the wire each host sent per timed "
          f"step (switch count, headers and ACKs included), mean (max); wire / ring payload: that over "
          f"2(N-1)/N x the encoded gradients; TSO offload {'on' if args.offload else 'off'}")
    print(table(_rows(configs, rounds, args),
                [("config", "config"), ("step", "step ms"), ("ratio", "vs best DDP, median (range)"),
                 ("mb", "MB sent per host per step"), ("wire", "wire / ring payload"), ("busy", "uplink busy")]))
    print("\n".join(sanity))
    if args.json:
        save(args.json, "wan", _rows(configs, rounds, args), sanity=sanity, hosts=args.world, delay_ms=args.delay_ms,
             rate_mbit=args.rate_mbit, mtu=args.mtu, rounds=args.rounds)


if __name__ == "__main__":
    main()
